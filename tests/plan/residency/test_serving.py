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
@given(seed=st.integers(0, 10_000), hot=st.integers(0, 9), scale=st.sampled_from([1, 7, 1 << 20]))
def test_a_weighted_plan_is_valid_for_any_weights(seed: int, hot: int, scale: int) -> None:
    """Whatever the weights (random, negative, on ranks not holding the expert, all zero
    for some experts), the weighted plan is valid over the slots: each expert's records
    kept, none on a rank not holding it, an expert with no weight left on its home."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 50, (4, 10), generator=g)
    c[:, hot] += 300
    slots = torch.tensor([[5, -1], [0, 9], [-1, -1], [1, 2]])
    w = torch.randint(-2, 5, (10, 4), generator=g) * scale
    w[hot] = 0  # no weight at all: its home takes it
    p = weighted_plan(c, slots, w)
    moonplan.check_plan(p, c, previous=serving_plan(c, slots))
    held = resident_map(slots, 10) | (home_map(10, 4)[:, None] == torch.arange(4))
    assert torch.equal(p.alloc.sum(1), c.sum(0)) and not bool(p.alloc[~held].any())
    assert int(p.alloc[hot, int(home_map(10, 4)[hot])]) == int(c[:, hot].sum())
    assert not bool(p.slot_new.any()) and torch.equal(p.slot_expert, slots)
