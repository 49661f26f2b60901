"""A contract violation on one rank raises the same clear error on every rank; nobody hangs."""

from __future__ import annotations

import pytest
import torch

from moonplan.testing.dist import run_ranks

pytestmark = pytest.mark.distributed

H, F, E, K = 8, 12, 5, 2


def _bad_step(rank: int, world: int, kind: str) -> tuple[str, bool]:
    """Rank 1 misbehaves; every rank reports the error it got, then runs a good step."""
    from moonplan import MoonMoE
    from moonplan.comm.errors import ContractError

    torch.manual_seed(rank)
    bad = rank == 1

    def router(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(x.shape[0])]).view(-1, K)
        w = torch.full((x.shape[0], K), 0.5)
        if bad and kind == "ids" and state["bad"]:
            ids[0, 0] = E + 3
        if bad and kind == "nan" and state["bad"]:
            w[0, 1] = float("nan")
        if bad and kind == "raise" and state["bad"]:
            raise KeyError("custom router failed")
        return ids, w

    state = {"bad": True}
    layer = MoonMoE(H, F, E, K, router=router)
    x = torch.randn(4, H if not (bad and kind == "shape") else H + 1)
    try:
        layer(x)
        message = ""
    except ContractError as exc:
        message = str(exc)
    state["bad"] = False
    y = layer(torch.randn(3, H))  # the layer (and its heap) still works afterwards
    return message, bool(torch.isfinite(y).all())


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("shape", "expected x of shape"),
        ("ids", "expert ids outside [0, 5)"),
        ("nan", "non-finite"),
        ("raise", "router raised KeyError"),
    ],
)
def test_bad_input_on_one_rank_raises_everywhere(kind: str, words: str) -> None:
    got = run_ranks(_bad_step, 3, kind, timeout=60)
    messages = {m for m, _ in got}
    assert len(messages) == 1, messages  # the same message on every rank
    (message,) = messages
    assert words in message and "rank 1" in message
    assert all(ok for _, ok in got)


def _mismatched(rank: int, world: int) -> str:
    from moonplan import MoonMoE
    from moonplan.comm.errors import ContractError

    try:
        MoonMoE(H, F + rank, E, K)  # rank-dependent ffn size: a config mismatch
    except ContractError as exc:
        return str(exc)
    return ""


def test_mismatched_configs_raise_everywhere() -> None:
    got = run_ranks(_mismatched, 2, timeout=60)
    assert got[0] == got[1] != ""
    assert "MoonMoE config" in got[0]


def test_constructor_rejects_bad_sizes() -> None:
    from moonplan import MoonMoE

    with pytest.raises(ValueError, match="top_k"):
        MoonMoE(8, 8, 2, 3)
    with pytest.raises(ValueError, match="hidden_size"):
        MoonMoE(0, 8, 2, 1)
    with pytest.raises(ValueError, match="router must be"):
        MoonMoE(8, 8, 2, 1, router="tanh")
    layer = MoonMoE(8, 8, 2, 1)
    with pytest.raises(ValueError, match="gate_up must have shape"):
        layer.load_dense(torch.zeros(2, 8), torch.zeros(2, 8, 8), torch.zeros(2, 8, 8))
