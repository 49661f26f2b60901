"""judged_order: the window's popular order, only where the cost model predicts its steps
faster under it with no slot kept (what the map alone gives)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonplan.plan.home_order import popular_order
from moonplan.plan.residency.home_choice import judged_order, map_s
from tests.baselines.test_auto_ordered import COST, _trace

HOT = torch.stack([c.sum(0) for c in _trace(3, seed=7)])  # [3, 16], hot experts 0-3


def test_hot_experts_in_one_block_are_spread() -> None:
    want = popular_order(HOT.sum(0), 4, list(range(16)))
    for slots in (0, 2, 4):
        got = judged_order(COST, HOT, 4, slots)
        assert got == want
        assert map_s(COST, HOT[:, torch.tensor(got)], 4, slots) < map_s(COST, HOT, 4, slots)


def test_an_order_that_does_not_shorten_the_steps_is_not_taken() -> None:
    """One giant expert: every order leaves its rank the busiest, as loaded as before."""
    load_SE = torch.tensor([[1000, 1, 1, 1, 1, 1, 1, 1]] * 2)
    assert popular_order(load_SE.sum(0), 4, list(range(8))) != list(range(8))
    assert judged_order(COST, load_SE, 4, 0) is None


def test_nothing_to_judge() -> None:
    assert judged_order(COST, torch.full((3, 16), 8), 4, 2) is None  # the identity
    assert judged_order(COST, torch.zeros(0, 16, dtype=torch.int64), 4, 2) is None


@settings(max_examples=25, deadline=None)
@given(
    loads=st.lists(st.lists(st.integers(0, 60), min_size=8, max_size=8), min_size=1, max_size=4),
    R=st.sampled_from([2, 4]),
    slots=st.integers(0, 2),
)
def test_an_order_returned_is_predicted_faster(loads, R, slots) -> None:
    loads_SE = torch.tensor(loads, dtype=torch.int64)
    got = judged_order(COST, loads_SE, R, slots)
    if got is not None:
        assert sorted(got) == list(range(8))
        assert map_s(COST, loads_SE[:, torch.tensor(got)], R, slots) < map_s(
            COST, loads_SE, R, slots
        )
