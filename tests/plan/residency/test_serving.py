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
from moonplan.plan.residency.shares import Shares, holders
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
    weight left on its home."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 50, (4, 10), generator=g)
    c[:, hot] += records
    slots = torch.tensor([[5, -1], [0, 9], [-1, -1], [1, 2]])
    w = torch.randint(-2, 5, (10, 4), generator=g) * scale
    w[hot] = 0  # no weight at all: its home takes it
    p = weighted_plan(c, slots, Shares(w, holders(resident_map(slots, 10))))
    moonplan.check_plan(p, c, previous=serving_plan(c, slots))
    held = resident_map(slots, 10) | (home_map(10, 4)[:, None] == torch.arange(4))
    assert torch.equal(p.alloc.sum(1), c.sum(0)) and not bool(p.alloc[~held].any())
    assert int(p.alloc[hot, int(home_map(10, 4)[hot])]) == int(c[:, hot].sum())
    assert not bool(p.slot_new.any()) and torch.equal(p.slot_expert, slots)


def test_an_expert_whose_holders_changed_since_the_fit_splits_evenly() -> None:
    """Shares fit for one table, served over slots that changed since: an expert whose
    holders are the same keeps its weights; one whose holders changed (a replica gone,
    or one new) splits evenly over its holders now, not by weights fit for others."""
    c = torch.zeros(4, 8, dtype=torch.int64)
    c[:, 0], c[:, 2] = 300, 200  # homes: expert 0 on rank 0, expert 2 on rank 1
    fit_RB = torch.tensor([[2, -1], [0, -1], [0, -1], [-1, -1]])  # 0 on 0-2, 2 on 1 and 0
    w = torch.zeros(8, 4, dtype=torch.int64)
    w[0, :3] = torch.tensor([6, 3, 3]) * 1000
    w[2, :2] = torch.tensor([1, 3]) * 1000
    w[[1, 3, 4, 5, 6, 7], [0, 1, 2, 2, 3, 3]] = 1
    shares = Shares.of(w, fit_RB)
    same = weighted_plan(c, fit_RB, shares)
    assert same.alloc[0, :3].tolist() == [600, 300, 300]
    assert same.alloc[2, :2].tolist() == [200, 600]
    now_RB = torch.tensor([[2, -1], [0, -1], [-1, -1], [0, -1]])  # expert 0: rank 3, not 2
    moved = weighted_plan(c, now_RB, shares)
    assert moved.alloc[0].tolist() == [400, 400, 0, 400]  # evenly over its holders now
    assert moved.alloc[2, :2].tolist() == [200, 600]  # its holders unchanged: its weights
