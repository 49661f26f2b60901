"""Counts for the simulator: drifting traces, inclusion probabilities, MaxVio targets."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from moonplan.simulate.workload import (
    drifting_counts,
    drifting_popularity,
    inclusion_probability,
    inclusion_probability_rows,
    popularity_maxvio,
    prehistory,
    recorded_counts,
    sigma_for_maxvio,
)


@pytest.mark.parametrize("exact", [False, True])
def test_drifting_counts_shapes_sums_and_determinism(exact: bool) -> None:
    c = drifting_counts(3, 10, 50, 2, sigma=1.0, steps=4, seed=5, exact=exact)
    assert c.shape == (4, 3, 10) and c.dtype == torch.int64
    assert (c.sum(2) == 100).all()
    assert torch.equal(c, drifting_counts(3, 10, 50, 2, sigma=1.0, steps=4, seed=5, exact=exact))
    if exact:
        assert int(c.max()) <= 50  # a token picks an expert at most once
    with pytest.raises(ValueError):
        drifting_counts(3, 10, 50, 2, sigma=-1.0, steps=4)


def test_inclusion_probability() -> None:
    q = inclusion_probability(torch.full((8,), 1 / 8, dtype=torch.float64), 2)
    assert q.tolist() == pytest.approx([0.25] * 8)
    skew = inclusion_probability(torch.tensor([0.9, 0.05, 0.03, 0.02], dtype=torch.float64), 2)
    assert float(skew.sum()) == pytest.approx(2.0) and float(skew.max()) <= 1.0
    assert inclusion_probability(torch.tensor([0.5, 0.5, 0.0]), 2).tolist() == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError):
        inclusion_probability(torch.tensor([1.0, 0.0]), 2)


def test_sigma_for_maxvio_round_trip() -> None:
    assert popularity_maxvio(0.0, 16) == pytest.approx(0.0)
    sigma = sigma_for_maxvio(1.5, 64, 4, seed=3)
    assert popularity_maxvio(sigma, 64, seed=3) == pytest.approx(1.5, rel=1e-6)
    assert sigma_for_maxvio(0.0, 64, 4) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="unreachable"):
        sigma_for_maxvio(15.0, 64, 4)  # top-4 caps MaxVio below 64/4 - 1 = 15


def test_recorded_counts(tmp_path: Path) -> None:
    np.save(tmp_path / "one.npy", np.ones((2, 3), dtype=np.int64))
    assert recorded_counts(tmp_path / "one.npy").shape == (1, 2, 3)
    np.save(tmp_path / "trace.npy", np.ones((4, 2, 3), dtype=np.int64))
    assert recorded_counts(tmp_path / "trace.npy").shape == (4, 2, 3)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


@pytest.mark.parametrize(
    ("exact", "seed", "digest"),
    [
        (False, 0, "8f4d0bfadf0cfdda"),
        (False, 7, "6bec8dd7a3df4504"),
        (True, 0, "4053d5dc41755ae3"),
        (True, 7, "4a0a6b54d48d85de"),
    ],
)
def test_drifting_counts_traces_are_unchanged(exact: bool, seed: int, digest: str) -> None:
    """Seeded traces of the drift-only law (``persistent=0``, the law before the persistent
    part) stay bit-identical (digests of the traces before drifting_counts and
    drifting_popularity shared one walk; exact=True draws from the walk's generator
    between its drifts)."""
    c = drifting_counts(4, 16, 64, 2, sigma=1.0, steps=5, rho=0.9, seed=seed, exact=exact,
                        persistent=0.0)  # fmt: skip
    assert _digest(c) == digest


@pytest.mark.parametrize(("seed", "digest"), [(0, "e44e86cd46489895"), (7, "a533315ce558b4e8")])
def test_drifting_popularity_is_unchanged(seed: int, digest: str) -> None:
    """The popularities to 2^-40: their last bits come from a vectorised ``exp`` (softmax),
    which differs between CPUs (the counts drawn from them are pinned exactly above)."""
    walk = drifting_popularity(16, sigma=1.0, steps=5, rho=0.9, seed=seed, persistent=0.0)
    pops = torch.stack(list(walk))
    assert _digest((pops * 2**40).round().long()) == digest


def test_persistent_share_keeps_sigma_and_splits_its_variance() -> None:
    """``mu`` carries the persistent share of ``sigma**2``, from its own generator: the walk
    draws the same numbers at any share, so the persistent part is the only difference."""
    from moonplan.traces.drift import persistent_log_popularity, split_sigma

    assert split_sigma(2.0, 0.75) == pytest.approx((math.sqrt(3.0), 1.0))
    mu = persistent_log_popularity(4096, 2.0, 0.75, seed=3)
    assert float(mu.var()) == pytest.approx(3.0, rel=0.1)
    assert torch.equal(persistent_log_popularity(8, 1.0, 0.0, seed=3), torch.zeros(8))
    frozen = torch.stack(list(drifting_popularity(64, sigma=1.0, steps=50, rho=0.9, seed=1,
                                                  persistent=1.0)))  # fmt: skip
    assert torch.allclose(frozen, frozen[0].expand_as(frozen))  # all persistent: no drift
    with pytest.raises(ValueError, match="persistent"):
        drifting_counts(2, 8, 16, 2, sigma=1.0, steps=2, persistent=1.5)


def test_prehistory_continues_the_trace_backwards_without_changing_it() -> None:
    """The steps before a trace: per-expert totals of the same law (``R * S * K`` records a
    step), deterministic, drawn from their own generators (the trace is the same with or
    without them); with no drift (``rho = 1``) they follow the trace's popularity."""
    args = {"sigma": 1.5, "rho": 1.0, "seed": 2, "persistent": 0.3}
    trace = drifting_counts(4, 32, 256, 4, steps=3, **args)
    steps = torch.tensor([-900, -899, -5, -1])
    before = prehistory(steps, ranks=4, experts=32, tokens=256, topk=4, **args)
    again = prehistory(steps, ranks=4, experts=32, tokens=256, topk=4, **args)
    assert torch.equal(before.totals_NE, again.totals_NE) and before.steps_N.tolist() == [
        -900, -899, -5, -1]  # fmt: skip
    assert before.totals_NE.sum(1).tolist() == [4 * 256 * 4] * 4
    assert torch.equal(trace, drifting_counts(4, 32, 256, 4, steps=3, **args))
    share_E = trace.sum((0, 1)).double() / trace.sum()
    before_E = before.totals_NE.sum(0).double() / before.totals_NE.sum()
    assert float((share_E - before_E).abs().sum()) < 0.08  # the same popularity, resampled
    drifting = prehistory(steps, ranks=4, experts=32, tokens=256, topk=4,
                          **{**args, "rho": 0.9})  # fmt: skip
    near = torch.corrcoef(torch.stack([drifting.totals_NE[-1], trace[0].sum(0)]).double())[0, 1]
    far = torch.corrcoef(torch.stack([drifting.totals_NE[0], trace[0].sum(0)]).double())[0, 1]
    assert near > far  # the drift forgets with distance, backwards as forwards
    with pytest.raises(ValueError, match="negative"):
        prehistory(torch.tensor([0]), ranks=4, experts=32, tokens=256, topk=4, **args)


def test_inclusion_probability_rows_agrees_with_the_bisection() -> None:
    gen = torch.Generator().manual_seed(0)
    for sigma in (0.0, 1.0, 3.0):
        pop_NE = torch.softmax(sigma * torch.randn(6, 40, generator=gen, dtype=torch.float64), 1)
        rows = inclusion_probability_rows(pop_NE, 5)
        one = torch.stack([inclusion_probability(p, 5) for p in pop_NE])
        assert torch.allclose(rows, one, atol=1e-12) and torch.allclose(
            rows.sum(1), 5 * one[:, 0] ** 0
        )
    exact = inclusion_probability_rows(torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64), 2)
    assert exact.tolist() == [[1.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="topk"):
        inclusion_probability_rows(torch.tensor([[1.0, 0.0]], dtype=torch.float64), 2)


def test_a_prehistory_step_does_not_depend_on_the_other_steps_asked_for() -> None:
    """Policies primed together ask for the union of their steps: each step's totals are
    the same whether it is asked alone, in a longer window or beside a far one."""
    args = {"ranks": 4, "experts": 16, "tokens": 64, "topk": 2, "sigma": 1.0, "rho": 0.99,
            "seed": 5, "persistent": 0.5}  # fmt: skip
    alone = prehistory(torch.arange(-32, 0), **args).totals_NE
    longer = prehistory(torch.arange(-1000, 0), **args).totals_NE
    apart = torch.cat([torch.arange(-2000, -1500), torch.arange(-32, 0)])
    both = prehistory(apart, **args)
    assert torch.equal(longer[-32:], alone) and torch.equal(both.totals_NE[-32:], alone)
    far = prehistory(torch.arange(-2000, -1500), **args).totals_NE
    assert torch.equal(both.totals_NE[:500], far)
