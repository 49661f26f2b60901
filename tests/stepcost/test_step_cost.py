"""StepCost: hand-computed phases, the overlapped schedule, construction and errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moonplan.cost import get_preset
from moonplan.stepcost import StepCost, get_hardware

# Round numbers so every expected time can be written by hand (seconds).
UNIT = StepCost(
    row_flop_s=1.0,
    weight_read_s=10.0,
    row_mem_s=0.0,
    copy_s_intra=100.0,
    copy_s_inter=1000.0,
    dispatch_row_s_intra=2.0,
    dispatch_row_s_inter=20.0,
    combine_row_s_intra=3.0,
    combine_row_s_inter=30.0,
    base_latency_s=0.0,
    per_peer_latency_s=0.0,
    plan_s=7.0,
    tile_rows=1,
)


def two_rank_case() -> tuple[torch.Tensor, ...]:
    """Expert 0 (home rank 0) has 40 rows from rank 0: 20 stay, 20 run on rank 1 after a copy."""
    rows_ER = torch.tensor([[20, 20], [0, 5]])
    sent_RE = torch.tensor([[40, 0], [0, 5]])
    fetch_ER = torch.tensor([[False, True], [False, False]])
    src_E = torch.tensor([0, 1])
    return rows_ER, sent_RE, fetch_ER, src_E


def test_roofline_per_rank_by_hand() -> None:
    rows_ER = torch.tensor([[3, 0], [1, 0]])
    tiled = UNIT.scaled(tile_rows=4, row_mem_s=1.0)
    # rank 0: flop 2 tiles * 4 rows = 8; memory 2 experts * 10 + 4 rows = 24 -> 24; rank 1 idle
    assert tiled.experts_R(rows_ER).tolist() == [24.0, 0.0]


def test_serial_schedule_by_hand() -> None:
    t = UNIT.scaled(overlap=False).step_time(*two_rank_case())
    # dispatch: rank 0 sends 20 rows to rank 1 -> 40; combine 60; copy of expert 0 -> 100
    # experts: rank 0 max(20, 10) = 20; rank 1 home 5 rows max(5, 10) = 10, fetched max(20, 10)
    assert (t.plan_s, t.dispatch_s, t.combine_s, t.prefetch_s) == (7.0, 40.0, 60.0, 100.0)
    assert t.experts_s == 30.0
    assert t.total_s == 7 + 100 + 40 + 30 + 60
    assert t.prefetch_exposed_s == 100.0


def test_overlapped_schedule_by_hand() -> None:
    t = UNIT.step_time(*two_rank_case())
    # the copy shares rank 0 -> 1 with dispatch: ready at 40 + 100 = 140; rank 1 runs its
    # home rows after dispatch (40 + max(5 rows, 10 weights + 10 for the copy it receives
    # beside them)), waits for the copy (140), then its 20 fetched rows
    assert t.total_s == 7 + max(40 + 20, 140) + 20 + 60
    assert t.experts_s == 40.0  # rank 1: 20 home (the copy's memory) + 20 fetched rows
    assert t.prefetch_exposed_s == t.total_s - (7 + 40 + 40 + 60)
    assert t.prefetch_s == 100.0


def test_a_copy_beside_the_home_rows_takes_memory_time_on_both_ends() -> None:
    """Decode-like: memory-bound home rows, a copy hidden behind them still costs each end
    one weight read of memory time."""
    rows_ER = torch.tensor([[1, 1], [0, 1]])  # expert 0's 2 rows split, expert 1 on rank 1
    sent_RE = torch.tensor([[2, 0], [0, 1]])
    fetch_ER = torch.tensor([[False, True], [False, False]])
    cost = UNIT.scaled(copy_s_intra=1.0)  # the copy is short: hidden behind the home rows
    t = cost.step_time(rows_ER, sent_RE, fetch_ER, torch.tensor([0, 1]))
    # rank 0 home: 1 row, 1 weight read + the copy it sends = 20; rank 1 home: 1 row,
    # 1 weight read + the copy it receives = 20, then its fetched row's weight read 10
    assert t.experts_s == 30.0
    serial = cost.scaled(overlap=False).step_time(rows_ER, sent_RE, fetch_ER, torch.tensor([0, 1]))
    assert serial.experts_s == 20.0  # the copy ran alone before: no memory taken


def test_nothing_fetched_is_the_same_in_both_schedules() -> None:
    rows_ER, sent_RE, fetch_ER, src_E = two_rank_case()
    none = torch.zeros_like(fetch_ER)
    a = UNIT.step_time(rows_ER, sent_RE, none, src_E)
    b = UNIT.scaled(overlap=False).step_time(rows_ER, sent_RE, none, src_E)
    assert a == b and a.prefetch_s == 0.0 and a.prefetch_exposed_s == 0.0
    # rank 0: max(20 rows, 1 weight) = 20; rank 1: max(25 rows, 2 weights) = 25
    assert a.total_s == 7 + 40 + 25 + 60


def test_planned_runs_are_charged() -> None:
    case = two_rank_case()
    assert UNIT.step_time(*case, planned=3).total_s - UNIT.step_time(*case).total_s == 14.0


def test_across_hosts_uses_the_slow_link() -> None:
    rows_ER, sent_RE, fetch_ER, src_E = two_rank_case()
    t = UNIT.scaled(domain=1, overlap=False).step_time(rows_ER, sent_RE, fetch_ER, src_E)
    assert (t.dispatch_s, t.prefetch_s) == (400.0, 1000.0)


def test_from_hardware_names_and_objects_agree() -> None:
    a = StepCost.from_hardware("H200-node", "Mixtral-8x7B")
    b = StepCost.from_hardware(get_hardware("h200-node"), get_preset("mixtral-8x7b"))
    assert a == b
    hw, m = get_hardware("h200-node"), get_preset("mixtral-8x7b")
    assert a.row_flop_s == pytest.approx(6 * m.hidden_size * m.moe_intermediate_size / hw.flops)
    assert a.tile_rows == hw.gemm_tile_rows and a.plan_s == pytest.approx(51e-6)


def test_tensor_round_trip_and_agreement_by_max() -> None:
    a = StepCost.from_hardware("h200-node", "deepseek-v3")
    back = StepCost.from_tensor(a.as_tensor(), tile_rows=a.tile_rows, domain=a.domain)
    assert back == a
    slower = a.scaled(copy_s_intra=2 * a.copy_s_intra)
    agreed = StepCost.from_tensor(torch.maximum(a.as_tensor(), slower.as_tensor()), tile_rows=128)
    assert agreed.copy_s_intra == slower.copy_s_intra and agreed.row_flop_s == a.row_flop_s
    exiting = a.scaled(exit_s=3e-6)  # the early exit's time is a rate, agreed like the rest
    assert StepCost.from_tensor(exiting.as_tensor(), tile_rows=128).exit_s == 3e-6


def test_rates_are_the_float_fields_in_tensor_order() -> None:
    names = [f.name for f in dataclasses.fields(StepCost) if f.type in ("float", float)]
    distinct = StepCost(**{n: float(i) for i, n in enumerate(names)})
    assert distinct.rates() == tuple(float(i) for i in range(len(names)))
    assert distinct.as_tensor().tolist() == list(distinct.rates())
    with pytest.raises(ValueError, match=r"StepCost\.exit_s must be a finite number"):
        distinct.scaled(exit_s=-1.0)


def test_step_time_in_microseconds_names_every_phase() -> None:
    t = UNIT.step_time(*two_rank_case())
    us = t.as_us()
    assert list(us) == [f"{f.name[:-2]}_us" for f in dataclasses.fields(t)]
    assert us["total_us"] == t.total_s * 1e6 and us["plan_us"] == 7e6


def test_horizon_is_deprecated_and_ignored() -> None:
    a = StepCost.from_hardware("h200-node", "deepseek-v3")
    assert a.horizon is None
    with pytest.warns(DeprecationWarning, match="horizon"):
        b = a.scaled(horizon=8.0)
    rows = torch.tensor([[50, 0], [0, 20]])
    sent = torch.tensor([[30, 10], [20, 10]])
    fetch = torch.tensor([[False, False], [True, False]])
    src = torch.tensor([0, 0])
    assert b.step_time(rows, sent, fetch, src) == a.step_time(rows, sent, fetch, src)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("row_flop_s", -1.0),
        ("copy_s_inter", float("nan")),
        ("tile_rows", 0),
        ("tile_rows", (1 << 31) + 1),  # a padded row count would near int64's range
        ("domain", -1),
        ("exit_s", -1e-6),
    ],
)
def test_bad_values_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        UNIT.scaled(**{field: value})


def test_mismatched_shapes_are_refused() -> None:
    rows_ER, sent_RE, fetch_ER, src_E = two_rank_case()
    with pytest.raises(ValueError, match="fetch_ER"):
        UNIT.step_time(rows_ER, sent_RE, fetch_ER[:1], src_E)
