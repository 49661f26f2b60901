"""``Plan.from_alloc``: a valid plan from any allocation, or a PlanError naming what is wrong."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moonplan
from moonplan import Plan, PlanError, check_plan
from moonplan.plan.from_alloc import _largest_first_host, _largest_first_sort, largest_first
from moonplan.testing import allocs, counts

LAYOUT = ("slot_expert", "slot_new", "row_expert", "row_count", "row_offset", "target")


@given(st.data())
def test_the_planners_allocation_gives_the_planners_layout(data: st.DataObject) -> None:
    first = data.draw(counts(max_ranks=7, max_experts=16))
    R, E = first.shape
    slots = data.draw(st.none() | st.integers(0, min(-(-E // R) + 1, E)))
    align = data.draw(st.sampled_from([1, 4]))
    prev = moonplan.plan(first, slots=slots) if data.draw(st.booleans()) else None
    c = data.draw(counts(min_ranks=R, max_ranks=R, min_experts=E, max_experts=E))
    p = moonplan.plan(c, slots=slots, align=align, previous=prev)
    q = Plan.from_alloc(c, p.alloc, slots=slots, align=align, previous=prev)
    for k in LAYOUT:
        assert torch.equal(getattr(p, k), getattr(q, k)), k
    assert q.policy == "custom" and q.planned == 0 and q.load_bound == int(p.target.max())
    assert bool((q.flow == torch.tensor([-1, -1, 0])).all())


@given(st.data())
def test_any_allocation_passes_the_policy_agnostic_checks(data: st.DataObject) -> None:
    c = data.draw(counts(max_ranks=6, max_experts=14))
    R, E = c.shape
    slots = data.draw(st.none() | st.integers(0, min(-(-E // R) + 2, E)))
    prev = moonplan.plan(c, slots=slots) if data.draw(st.booleans()) else None
    alloc_ER = data.draw(allocs(c, slots=slots))
    bound = int(alloc_ER.sum(0).max()) + data.draw(st.integers(0, 3))
    ref = Plan.from_alloc(
        c, alloc_ER, slots=slots, previous=prev, load_bound=bound, backend="reference"
    )
    got = Plan.from_alloc(c, alloc_ER, slots=slots, previous=prev, load_bound=bound)
    for k in ("alloc", "home", "flow", *LAYOUT):
        assert torch.equal(getattr(ref, k), getattr(got, k)), k
    check_plan(got, c, previous=prev, strict=False)
    assert got.load_bound == bound


def test_two_donor_groups_on_one_rank() -> None:
    # Ranks 0 and 1 each give rank 2 part of their excess: exactly balanced, but rank 2
    # is filled by two groups, which moonplan's construction never does.
    c = torch.tensor([[3, 3, 3, 3, 0, 0], [0] * 6, [0] * 6])
    alloc = [[1, 0, 2], [3, 0, 0], [0, 1, 2], [0, 3, 0], [0, 0, 0], [0, 0, 0]]
    p = Plan.from_alloc(c, alloc, policy="two-donors")
    assert p.alloc.sum(0).tolist() == [4, 4, 4] and p.load_bound == 4
    check_plan(p, c, strict=False)
    check_plan(p, c)  # no flow record to check: strict holds it to its bound and M
    exact = Plan.from_alloc(c, alloc, policy="exact")
    check_plan(exact, c, strict=False)
    with pytest.raises(PlanError, match="flow record"):
        check_plan(exact, c)  # claims exact: held to the construction record


def test_load_above_the_declared_bound_is_rejected() -> None:
    c = torch.tensor([[6, 2], [0, 0]])
    p = Plan.from_alloc(c, [[3, 3], [0, 2]], load_bound=5)
    check_plan(p, c, strict=False)
    tight = Plan.from_alloc(c, [[6, 0], [2, 0]])
    assert tight.load_bound == 8
    lying = dataclasses.replace(tight, declared_bound=7)
    with pytest.raises(PlanError, match="declared load bound"):
        check_plan(lying, c, strict=False)


@pytest.mark.parametrize(
    ("alloc", "message"),
    [
        ([[6, 0]], r"shape \[E, R\] = \[2, 2\], got \[1, 2\]"),
        ([[7, -1], [2, 0]], r"non-negative: alloc\[0, 1\] = -1"),
        ([[5, 0], [2, 0]], "expert 0 is routed 6 records but alloc"),
        ([[6.0, 0.0], [2.0, 0.0]], "integer dtype"),
        ("six", "integer"),
    ],
)
def test_bad_allocations_name_the_problem(alloc: object, message: str) -> None:
    c = torch.tensor([[6, 2], [0, 0]])
    with pytest.raises(PlanError, match=message):
        Plan.from_alloc(c, alloc)


def test_more_remote_experts_than_rows_and_a_low_bound_are_rejected() -> None:
    c = torch.tensor([[5, 5, 5, 5, 0, 0], [0] * 6, [0] * 6])  # M = 2
    spread = [[3, 0, 2], [3, 0, 2], [0, 3, 2], [0, 3, 2], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(PlanError, match=r"rank 2 executes 4 remote experts.*at most .* = 2"):
        Plan.from_alloc(c, spread, slots=1)
    p = Plan.from_alloc(c, spread, slots=4)  # four slots hold them
    check_plan(p, c, strict=False)
    assert p.remote_experts().tolist() == [0, 0, 4]
    with pytest.raises(PlanError, match="invariant 3"):
        check_plan(p, c)  # strict: moonplan's bound ceil(E/R)
    with pytest.raises(PlanError, match="load_bound 7 is below the largest load 8"):
        Plan.from_alloc(c, spread, slots=4, load_bound=7)
    with pytest.raises(PlanError, match="previous plan has"):
        Plan.from_alloc(c, spread, slots=4, previous=moonplan.plan(c, slots=2))


@given(st.data())
def test_largest_first_on_the_host_is_the_sorted_order(data: st.DataObject) -> None:
    """CPU tensors order their replicas on the host; other devices sort every row: the
    same candidates either way (ties, rows without any, ``K`` below and above the
    number of replicas), and "meta" tensors take the sorting path."""
    R, E = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 12))
    values = st.integers(0, 3) if data.draw(st.booleans()) else st.integers(0, 10**6)
    rec = torch.tensor(data.draw(st.lists(values, min_size=R * E, max_size=R * E))).view(R, E)
    rec_RE = rec.t().contiguous().t() if data.draw(st.booleans()) else rec  # strided too
    K = data.draw(st.integers(0, E + 2))
    want = _largest_first_sort(rec_RE, K)
    assert torch.equal(_largest_first_host(rec_RE, K), want), (rec.tolist(), K)
    assert torch.equal(largest_first(rec_RE, K), want)
    meta = largest_first(rec_RE.to("meta"), K)
    assert meta.device.type == "meta" and meta.shape == (R, K)
