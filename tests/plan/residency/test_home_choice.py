"""judged_order: the window's popular order, only where the cost model predicts its steps
faster under it (from empty slots, as a re-home leaves them)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonplan.plan.home_order import popular_order
from moonplan.plan.residency.home_choice import judged_order, window_best_s
from tests.baselines.test_auto_ordered import COST, _trace

HOT = torch.stack([c.sum(0) for c in _trace(3, seed=7)])  # [3, 16], hot experts 0-3


def test_hot_experts_in_one_block_are_spread_where_no_replica_absorbs_them() -> None:
    want = popular_order(HOT.sum(0), 4, list(range(16)))
    for slots, stale in ((0, False), (2, True), (4, True)):  # no slot, or slots gone stale
        got = judged_order(COST, HOT, 4, slots, stale)
        assert got == want
        after = window_best_s(COST, HOT[:, torch.tensor(got)], 4, slots, stale)
        assert after < window_best_s(COST, HOT, 4, slots, stale)


def test_slots_that_stay_can_make_the_order_not_pay() -> None:
    """With 4 slots that stay, replicas absorb the hot block: the window is predicted no
    faster under the order, so the map stays (the same slots gone stale: it pays)."""
    assert judged_order(COST, HOT, 4, 4) is None
    assert judged_order(COST, HOT, 4, 4, stale=True) is not None


def test_nothing_to_judge() -> None:
    assert judged_order(COST, torch.full((3, 16), 8), 4, 2) is None  # the identity
    assert judged_order(COST, torch.zeros(0, 16, dtype=torch.int64), 4, 2) is None


@settings(max_examples=25, deadline=None)
@given(
    loads=st.lists(st.lists(st.integers(0, 60), min_size=8, max_size=8), min_size=1, max_size=4),
    R=st.sampled_from([2, 4]),
    slots=st.integers(0, 2),
    stale=st.booleans(),
)
def test_an_order_returned_is_predicted_faster(loads, R, slots, stale) -> None:
    loads_SE = torch.tensor(loads, dtype=torch.int64)
    got = judged_order(COST, loads_SE, R, slots, stale)
    if got is not None:
        assert sorted(got) == list(range(8))
        after = window_best_s(COST, loads_SE[:, torch.tensor(got)], R, slots, stale)
        assert after < window_best_s(COST, loads_SE, R, slots, stale)
