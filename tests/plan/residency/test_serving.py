"""The serving plan a refill leaves (static EP's records over a given slot table), and the
weighted lookup's plan over one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moonplan
from moonplan.errors import PlanError
from moonplan.plan.home import home_map
from moonplan.plan.residency.serving import serving_plan, weighted_plan
from moonplan.plan.residency.shares import Shares
from moonplan.plan.torch_backend import resident_map


def test_the_serving_plan_holds_the_slots_resident_and_is_valid() -> None:
    c = torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([[5, -1], [0, 9], [-1, -1], [1, 2]])
    p = serving_plan(c, slots)
    assert torch.equal(p.slot_expert, slots) and not bool(p.slot_new.any())
    moonplan.check_plan(p, c, previous=p)
    nxt = moonplan.plan(c, slots=2, previous=p, policy="resident")  # the next step's plan
    assert torch.equal(nxt.slot_expert, slots) and nxt.new_copies() == 0


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        ([[5, 5], [0, 9], [-1, -1], [1, 2]], "twice"),
        ([[0, -1], [3, 9], [-1, -1], [1, 2]], "own home"),
        ([[10, -1], [0, 9], [-1, -1], [1, 2]], "outside"),
        ([[5, -1], [0, 9], [-1, -1]], r"\[R=4, B\]"),
    ],
)
def test_a_bad_slot_table_is_refused(slots: list[list[int]], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        serving_plan(torch.ones(4, 10, dtype=torch.int64), torch.tensor(slots))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    hot=st.integers(0, 9),
    scale=st.sampled_from([1, 7, 1 << 20, 1 << 40]),
    records=st.sampled_from([300, 10_000_000]),
)
def test_a_weighted_plan_is_valid_for_any_weights(
    seed: int, hot: int, scale: int, records: int
) -> None:
    """Whatever the weights (random, negative, huge, on ranks not holding the expert, all
    zero for some experts) and however many records, the weighted plan is valid over the
    slots: each expert's records kept, none on a rank not holding it, an expert with no
    weight left split evenly over its holders."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 50, (4, 10), generator=g)
    c[:, hot] += records
    slots = torch.tensor([[5, -1], [0, 9], [-1, -1], [1, 2]])
    w = torch.randint(-2, 5, (10, 4), generator=g) * scale
    w[hot] = 0  # no weight at all: its holders split it evenly
    p = weighted_plan(c, slots, Shares(w))
    moonplan.check_plan(p, c, previous=serving_plan(c, slots))
    held = resident_map(slots, 10) | (home_map(10, 4)[:, None] == torch.arange(4))
    assert torch.equal(p.alloc.sum(1), c.sum(0)) and not bool(p.alloc[~held].any())
    hot_H = p.alloc[hot][held[hot]]  # no weight left: evenly over its holders
    assert int(hot_H.max() - hot_H.min()) <= 1
    assert not bool(p.slot_new.any()) and torch.equal(p.slot_expert, slots)


def test_weights_on_ranks_that_no_longer_hold_an_expert_are_dropped() -> None:
    """Shares fit for one table, served over slots that changed since: an expert keeps its
    weights on the ranks that still hold it, in proportion; one left with no weight splits
    evenly over its holders now; one unchanged keeps its weights."""
    c = torch.zeros(4, 8, dtype=torch.int64)
    c[:, 0], c[:, 2], c[:, 4] = 300, 200, 100  # homes: expert 0 on rank 0, 2 on 1, 4 on 2
    fit_RB = torch.tensor([[2, 4], [0, -1], [0, -1], [-1, -1]])  # 0 on 0-2, 2 on 1 and 0
    w = torch.zeros(8, 4, dtype=torch.int64)
    w[0, :3] = torch.tensor([6, 3, 3]) * 1000
    w[2, :2] = torch.tensor([1, 3]) * 1000
    w[4, 0] = 1000  # all of expert 4 on its replica on rank 0, none at home
    w[[1, 3, 5, 6, 7], [0, 1, 2, 3, 3]] = 1
    same = weighted_plan(c, fit_RB, Shares(w))
    assert same.alloc[0, :3].tolist() == [600, 300, 300]
    assert same.alloc[2, :2].tolist() == [200, 600] and same.alloc[4, 0] == 400
    now_RB = torch.tensor([[2, -1], [0, -1], [-1, -1], [0, -1]])  # 0: rank 3, not 2; 4 gone
    moved = weighted_plan(c, now_RB, Shares(w))
    assert moved.alloc[0].tolist() == [800, 400, 0, 0]  # rank 2's weight dropped, 6:3 kept
    assert moved.alloc[2, :2].tolist() == [200, 600]  # its holders unchanged: its weights
    assert moved.alloc[4].tolist() == [0, 0, 400, 0]  # no weight left: its holders, evenly


def test_lookup_way_dispatches_and_refuses_a_weighted_way_without_shares() -> None:
    """``lookup_way`` serves the even lookups as ``lookup_plan`` and the weighted one as
    ``weighted_plan``; the weighted one without its shares is an error, not a guess."""
    from moonplan.plan.residency.serving import lookup_plan, lookup_way

    c = torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(3))
    slots = torch.tensor([[5, -1], [0, 9], [-1, -1], [1, 2]])
    assert torch.equal(
        lookup_way(c, slots, "split", None).alloc, lookup_plan(c, slots, "split").alloc
    )
    w = torch.randint(1, 9, (10, 4), generator=torch.Generator().manual_seed(4))
    got = lookup_way(c, slots, "weighted", Shares(w))
    assert torch.equal(got.alloc, weighted_plan(c, slots, Shares(w)).alloc)
    with pytest.raises(ValueError, match="weighted lookup is served with its decision's shares"):
        lookup_way(c, slots, "weighted", None)
