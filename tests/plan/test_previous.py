"""Resident slots (``previous=``): invariants, residents kept, and fewer weight copies."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import moonplan
from moonplan.baselines import moonep_greedy_alloc, replica_count
from moonplan.testing import check_plan, counts
from moonplan.traces import DriftingTrace


@given(st.data())
def test_invariants_hold_along_a_sequence(data: st.DataObject) -> None:
    first = data.draw(counts(max_ranks=6, max_experts=14))
    R, E = first.shape
    opts = {"slots": data.draw(st.none() | st.integers(0, min(-(-E // R) + 1, E)))}  # <= E
    prev = None
    for step in range(4):
        c = (
            first
            if step == 0
            else data.draw(counts(min_ranks=R, max_ranks=R, min_experts=E, max_experts=E))
        )
        p = moonplan.plan(c, previous=prev, **opts)
        check_plan(p, c, previous=prev)
        prev = p


def test_same_counts_twice_moves_no_weights() -> None:
    c = DriftingTrace(8, 64, 512, 4, seed=3).step()
    first = moonplan.plan(c)
    again = moonplan.plan(c, previous=first)
    check_plan(again, c, previous=first)
    assert first.new_copies() == first.copies() > 0
    assert again.new_copies() == 0
    assert torch.equal(again.alloc, first.alloc)


def test_unused_residents_stay_in_free_slots() -> None:
    hot = torch.tensor([[40, 0, 0, 0], [0, 0, 0, 0]])  # rank 1 needs expert 0
    cold = torch.tensor([[5, 5, 5, 5], [5, 5, 5, 5]])  # balanced: nothing to move
    first = moonplan.plan(hot)
    assert first.slot_expert[1].tolist() == [0, -1]
    second = moonplan.plan(cold, previous=first)
    check_plan(second, cold, previous=first)
    assert second.copies() == 0
    assert second.slot_expert[1].tolist() == [0, -1]  # still resident, not executed
    assert second.slot_new.sum() == 0
    third = moonplan.plan(hot, previous=second)
    assert third.new_copies() == 0  # the resident is reused


def test_without_previous_no_stale_residents_are_allowed() -> None:
    hot = torch.tensor([[40, 0, 0, 0], [0, 0, 0, 0]])
    cold = torch.tensor([[5, 5, 5, 5], [5, 5, 5, 5]])
    second = moonplan.plan(cold, previous=moonplan.plan(hot))
    try:
        check_plan(second, cold)  # checked as if made without previous=
    except moonplan.PlanError as exc:
        assert "neither used nor resident" in str(exc)
    else:
        raise AssertionError("a resident kept without previous= must be reported")


def _new_over_greedy(R: int, E: int, S: int, K: int, rho: float, steps: int) -> float:
    trace = DriftingTrace(R, E, S, K, sigma=1.0, rho=rho, seed=1)
    prev, new, greedy = None, 0, 0
    for t in range(steps):
        c = trace.step()
        p = moonplan.plan(c, previous=prev)
        check_plan(p, c, previous=prev)
        if t >= 3:  # steady state
            new += p.new_copies()
            greedy += replica_count(moonep_greedy_alloc(c))
        prev = p
    return new / greedy


def test_slow_drift_new_copies_at_most_15_percent_of_greedy() -> None:
    # Slow drift: log-popularity AR(1) with rho = 0.999 plus per-step sampling noise.
    assert _new_over_greedy(8, 64, 2048, 8, 0.999, 20) <= 0.15
    assert _new_over_greedy(16, 128, 1024, 8, 0.999, 16) <= 0.15
