"""Dispatch traffic split by link, and the hardware presets."""

from __future__ import annotations

import pytest
import torch

from moonplan.simulate.models import DEEPSPEED_MOE_128, expert_bytes, get_model, gshard_model
from moonplan.stepcost.hardware import HARDWARE, get_hardware
from moonplan.stepcost.traffic import dispatch_traffic, pair_traffic


def test_uniform_static_traffic_splits_by_node() -> None:
    sent = torch.ones(4, 4, dtype=torch.int64)  # every source sends 1 to every expert
    rows = torch.diag(torch.full((4,), 4, dtype=torch.int64))  # expert e runs on rank e
    t = dispatch_traffic(sent, rows, domain=2)
    assert t.local_R.tolist() == [1, 1, 1, 1]
    assert t.send_intra_R.tolist() == [1, 1, 1, 1] and t.recv_intra_R.tolist() == [1, 1, 1, 1]
    assert t.send_inter_R.tolist() == [2, 2, 2, 2] and t.recv_inter_R.tolist() == [2, 2, 2, 2]
    one = dispatch_traffic(sent, rows, domain=4)
    assert one.send_inter_R.tolist() == [0, 0, 0, 0] and one.send_intra_R.tolist() == [3] * 4


def test_split_expert_routes_consecutive_segments() -> None:
    # expert 0: sources 0,1 send 3 and 1; ranks 0 and 1 execute 2 each -> source 0 keeps 2,
    # sends 1 to rank 1; source 1's record lands on rank 1 (local)
    sent = torch.tensor([[3], [1]])
    rows = torch.tensor([[2, 2]])
    t = dispatch_traffic(sent, rows, domain=2)
    assert t.local_R.tolist() == [2, 1]
    assert t.send_intra_R.tolist() == [1, 0] and t.recv_intra_R.tolist() == [0, 1]
    with pytest.raises(ValueError):
        dispatch_traffic(sent, torch.tensor([[2, 1]]), domain=2)


def test_pair_traffic() -> None:
    t = pair_traffic(torch.tensor([[0, 1], [0, 2], [3, 3]]), 4, domain=2)
    assert t.send_intra_R.tolist() == [1, 0, 0, 0] and t.send_inter_R.tolist() == [1, 0, 0, 0]
    assert t.recv_intra_R.tolist() == [0, 1, 0, 0] and t.recv_inter_R.tolist() == [0, 0, 1, 0]
    assert t.local_R.tolist() == [0, 0, 0, 1]


def test_hardware_presets() -> None:
    h200 = get_hardware("H200-node")
    assert h200.flops == pytest.approx(790e12)
    assert h200.nvlink_effective == pytest.approx(450e9 * 0.75)
    assert h200.domain(512) == 512 and get_hardware("h200-multinode").domain(512) == 8
    assert get_hardware("h20-multinode").domain(4) == 4
    assert all(h.source for h in HARDWARE.values())
    with pytest.raises(ValueError, match="valid choices"):
        get_hardware("tpu")


def test_models() -> None:
    assert get_model("deepseek-v3").num_experts == 256
    assert get_model("gshard-2048e").num_experts == 2048 == gshard_model(2048).num_experts
    assert get_model("deepspeed-moe-1.3b-128") is DEEPSPEED_MOE_128
    # two-matrix FFN of 4*2048 kept within rounding: 3*H*F ~= 2*H*8192
    assert expert_bytes(DEEPSPEED_MOE_128, 1) == pytest.approx(2 * 2048 * 8192, rel=1e-4)
    with pytest.raises(ValueError, match="valid choices"):
        get_model("gpt-5")
