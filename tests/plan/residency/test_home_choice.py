"""judged_order: the window's popular order, only where the cost model predicts its steps
faster under it: with no slot kept against a running layer's slots, or best table against
best table before a trace."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonplan.plan.home_order import popular_order
from moonplan.plan.residency.home_choice import judged_order, map_s, serving_s, table_s
from tests.baselines.test_auto_ordered import COST, _trace

HOT = torch.stack([c.sum(0) for c in _trace(3, seed=7)])  # [3, 16], hot experts 0-3


def _empty(R: int, B: int) -> torch.Tensor:
    return torch.full((R, B), -1, dtype=torch.int64)


def test_hot_experts_in_one_block_are_spread_against_empty_slots() -> None:
    want = popular_order(HOT.sum(0), 4, list(range(16)))
    for slots in (0, 2, 4):
        got = judged_order(COST, HOT, 4, slots, _empty(4, slots))
        assert got == want
        moved = HOT[:, torch.tensor(got)]
        assert map_s(COST, moved, 4, slots) < serving_s(COST, HOT, _empty(4, slots))


def test_before_a_trace_each_map_gets_its_best_table() -> None:
    """With 4 slots placed before the trace the replicas absorb the hot block: the order's
    best table is no faster, so the map stays; with none the order is taken."""
    assert judged_order(COST, HOT, 4, 4) is None
    moved = HOT[:, torch.tensor(popular_order(HOT.sum(0), 4, list(range(16))))]
    assert table_s(COST, moved, 4, 4) >= table_s(COST, HOT, 4, 4)
    assert judged_order(COST, HOT, 4, 0) is not None


def test_a_running_layer_with_a_good_table_keeps_its_map() -> None:
    """The table the window prefers, serving already: the order from empty slots must
    beat it at once, and does not."""
    from moonplan.plan.residency.target import target_of

    table_RB = target_of(HOT.sum(0), 3, _empty(4, 4), COST, HOT).slot_RB
    assert judged_order(COST, HOT, 4, 4, table_RB) is None


def test_an_order_that_does_not_shorten_the_steps_is_not_taken() -> None:
    """One giant expert: every order leaves its rank the busiest, as loaded as before."""
    load_SE = torch.tensor([[1000, 1, 1, 1, 1, 1, 1, 1]] * 2)
    assert popular_order(load_SE.sum(0), 4, list(range(8))) != list(range(8))
    assert judged_order(COST, load_SE, 4, 0, _empty(4, 0)) is None
    assert judged_order(COST, load_SE, 4, 0) is None


def test_nothing_to_judge() -> None:
    assert judged_order(COST, torch.full((3, 16), 8), 4, 2) is None  # the identity
    assert judged_order(COST, torch.zeros(0, 16, dtype=torch.int64), 4, 2) is None


@settings(max_examples=25, deadline=None)
@given(
    loads=st.lists(st.lists(st.integers(0, 60), min_size=8, max_size=8), min_size=1, max_size=4),
    R=st.sampled_from([2, 4]),
    slots=st.integers(0, 2),
    running=st.booleans(),
)
def test_an_order_returned_is_predicted_faster(loads, R, slots, running) -> None:
    loads_SE = torch.tensor(loads, dtype=torch.int64)
    serving = _empty(R, slots) if running else None
    got = judged_order(COST, loads_SE, R, slots, serving)
    if got is not None:
        assert sorted(got) == list(range(8))
        moved = loads_SE[:, torch.tensor(got)]
        if running:
            assert map_s(COST, moved, R, slots) < serving_s(COST, loads_SE, _empty(R, slots))
        else:
            assert table_s(COST, moved, R, slots) < table_s(COST, loads_SE, R, slots)
