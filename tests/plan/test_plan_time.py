"""plan_time and plan_fetch_ER: a plan's predicted step and its fetched pairs; the old
StepCost.plan_time and moonplan.stepcost.plan_fetch_ER warn and agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moonplan
from moonplan.plan import plan_time as plan_time_module
from moonplan.plan.plan_time import plan_fetch_ER, plan_time
from moonplan.stepcost import StepCost
from moonplan.stepcost.fetch_pairs import fetch_pairs_ER
from moonplan.traces import DriftingTrace

COST = StepCost.from_hardware("h200-node", "mixtral-8x7b")


def drifting_plan() -> moonplan.Plan:
    """A plan of a drifting trace with one slot per rank and a previous plan."""
    trace = DriftingTrace(4, 16, 200, 4, sigma=1.5, seed=2)
    prev = moonplan.plan(trace.step(), slots=1)
    return moonplan.plan(trace.step(), slots=1, previous=prev)


def test_plan_time_fetches_new_slots_and_direct_reads() -> None:
    counts = torch.tensor([[90, 5, 5, 0], [0, 0, 0, 0]])  # R=2, E=4: rank 0 overloaded
    full = moonplan.plan(counts)  # replicas of expert 0 in a slot on rank 1
    fetch = plan_fetch_ER(full)
    expected = torch.zeros(4, 2, dtype=torch.bool)
    expected[0, 1] = True  # rank 0 gives 45 records of expert 0 to rank 1
    assert torch.equal(fetch, expected)
    none = moonplan.plan(counts, slots=0)  # no slots: the same replica is a direct read
    assert torch.equal(plan_fetch_ER(none), fetch)
    again = moonplan.plan(counts, previous=full)  # resident: nothing moves
    assert not plan_fetch_ER(again).any()
    assert plan_time(COST, full).prefetch_s > 0 and plan_time(COST, again).prefetch_s == 0.0


def test_plan_time_is_the_step_time_of_the_plan_from_one_host_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``plan_time`` is ``step_time`` of the plan's tensors, bit for bit, and copies the
    allocation to the host once (for the rows and the fetched pairs alike)."""
    p = drifting_plan()
    want = COST.step_time(p.alloc, p.counts, plan_fetch_ER(p), p.home, planned=2)
    copies: list[bool] = []
    real = plan_time_module.host_int64
    monkeypatch.setattr(
        plan_time_module, "host_int64", lambda a: copies.append(a is p.alloc) or real(a)
    )
    assert plan_time(COST, p, planned=2) == want
    assert sum(copies) == 1


def test_fetch_pairs_need_rows_and_a_new_slot_or_a_direct_read() -> None:
    alloc_ER = np.array([[5, 0], [0, 3], [2, 2]])  # E=3, R=2
    slot_RB = np.array([[1, 2], [0, -1]])
    new_RB = np.array([[0, 1], [1, 0]])  # rank 0 refills expert 2; rank 1 expert 0
    direct_RD = np.array([[-1], [2]])  # rank 1 reads expert 2 in place
    fetch_ER = fetch_pairs_ER(alloc_ER, slot_RB, new_RB, direct_RD)
    # expert 0 on rank 1 has no rows: not fetched; expert 1 is a kept resident
    assert fetch_ER.tolist() == [[False, False], [False, False], [True, True]]


def test_the_old_entry_points_warn_and_agree() -> None:
    p = drifting_plan()
    with pytest.warns(DeprecationWarning, match=r"plan_time\(cost, plan\)"):
        old = COST.plan_time(p, planned=2)
    assert old == plan_time(COST, p, planned=2)
    from moonplan.stepcost import plan_fetch_ER as old_fetch

    with pytest.warns(DeprecationWarning, match="moonplan.plan.plan_time"):
        assert torch.equal(old_fetch(p), plan_fetch_ER(p))
