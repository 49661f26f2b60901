"""judged_order: the window's popular order, only where the cost model predicts its steps
faster under it: with no slot kept against a running layer's slots, or best table against
best table before a trace."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonplan.plan.home_order import popular_order
from moonplan.plan.residency.home_choice import (
    candidate_orders,
    judged_order,
    map_way,
    relabelled,
    serving_s,
    shared_order,
    table_way,
    window_order,
)
from moonplan.plan.residency.target import replica_counts
from tests.baselines.test_auto_ordered import COST, _trace

HOT = torch.stack([c.sum(0) for c in _trace(3, seed=7)])  # [3, 16], hot experts 0-3


def _empty(R: int, B: int) -> torch.Tensor:
    return torch.full((R, B), -1, dtype=torch.int64)


def test_hot_experts_in_one_block_are_spread_against_empty_slots() -> None:
    want = popular_order(HOT.sum(0), 4, list(range(16)))
    for slots in (0, 2, 4):
        judged = judged_order(COST, HOT, 4, slots, _empty(4, slots))
        assert judged is not None and list(judged.perm_E) == want and not judged.stale
        moved = HOT[:, torch.tensor(want)]
        now_s, after_s = serving_s(COST, HOT, _empty(4, slots)), map_way(COST, moved, 4, slots)[0]
        assert after_s < now_s and judged.saving_s == (now_s - after_s) / 3
        assert judged.serve == map_way(COST, moved, 4, slots)[1]  # its steps' way, no slot


def test_before_a_trace_each_map_gets_its_best_table() -> None:
    """With 4 slots placed before the trace the replicas absorb the hot block: the order's
    best table is no faster, so the map stays; with none the order is taken."""
    assert judged_order(COST, HOT, 4, 4) is None
    moved = HOT[:, torch.tensor(popular_order(HOT.sum(0), 4, list(range(16))))]
    assert table_way(COST, moved, 4, 4)[0] >= table_way(COST, HOT, 4, 4)[0]
    assert judged_order(COST, HOT, 4, 0) is not None


def test_the_shares_order_packs_each_expert_by_its_load_per_holder() -> None:
    """Expert 0 gets three holders of the 4 replicas, its home one third of its records:
    its block partner is chosen for that third, not for the whole."""
    load_SE = torch.tensor([[120, 40, 30, 30, 20, 20, 10, 10]] * 2)
    n_E = replica_counts(load_SE.sum(0).tolist(), 4, 4)
    share_E = load_SE.sum(0).double() / torch.tensor(n_E, dtype=torch.float64)
    got = shared_order(load_SE, 4, 1)
    assert got == popular_order(share_E, 4, list(range(8)))
    assert got != window_order(load_SE, 4)  # whole loads pair expert 0 with the lightest
    assert shared_order(load_SE, 4, 0) is None  # no slot, no replica to anticipate
    assert shared_order(load_SE[:0], 4, 1) is None
    assert shared_order(torch.tensor([[40, 10] * 4]), 4, 1) is None  # the identity


def test_before_a_trace_the_shares_order_is_taken_where_its_table_is_faster() -> None:
    """Two steps where the shares order's best table is predicted faster than the popular
    order's: the judgement takes it, with the saving against the labels' own table."""
    load_SE = torch.tensor([[36, 32, 11, 33, 33, 24, 24, 10], [21, 41, 12, 37, 23, 22, 27, 7]])
    popular, shares = window_order(load_SE, 4), shared_order(load_SE, 4, 1)
    assert popular is not None and shares is not None and popular != shares
    popular_s = table_way(COST, relabelled(load_SE, popular), 4, 1)[0]
    shares_s, way = table_way(COST, relabelled(load_SE, shares), 4, 1)
    assert shares_s < popular_s
    judged = judged_order(COST, load_SE, 4, 1)
    assert judged is not None and list(judged.perm_E) == shares and judged.serve == way
    assert judged.saving_s == (table_way(COST, load_SE, 4, 1)[0] - shares_s) / 2


@settings(max_examples=25, deadline=None)
@given(
    loads=st.lists(st.lists(st.integers(0, 60), min_size=8, max_size=8), min_size=1, max_size=3),
    R=st.sampled_from([2, 4]),
    slots=st.integers(1, 2),
)
def test_before_a_trace_no_candidate_has_a_faster_table(loads, R, slots) -> None:
    loads_SE = torch.tensor(loads, dtype=torch.int64)
    judged = judged_order(COST, loads_SE, R, slots)
    got_s = table_way(
        COST, loads_SE if judged is None else relabelled(loads_SE, list(judged.perm_E)), R, slots
    )[0]
    for perm_E in (window_order(loads_SE, R), shared_order(loads_SE, R, slots), None):
        moved = loads_SE if perm_E is None else relabelled(loads_SE, perm_E)
        assert got_s <= table_way(COST, moved, R, slots)[0]


def test_a_running_layer_takes_of_the_orders_faster_now_the_one_with_the_faster_table() -> None:
    """Both orders beat the empty slots at once; the popular order more so, but the shares
    order's best table is faster: it is taken, its saving the one it makes at once."""
    load_SE = torch.tensor([[158, 58, 2, 55, 54, 11, 1, 162], [141, 61, 1, 65, 38, 12, 1, 149]])
    empty = _empty(4, 1)
    popular, shares = window_order(load_SE, 4), shared_order(load_SE, 4, 1)
    assert popular is not None and shares is not None and popular != shares
    now_s = serving_s(COST, load_SE, empty)
    (pop_s, _), (sha_s, way) = (
        map_way(COST, relabelled(load_SE, p), 4, 1) for p in (popular, shares)
    )
    assert pop_s < sha_s < now_s  # both faster at once
    steady = [table_way(COST, relabelled(load_SE, p), 4, 1)[0] for p in (popular, shares)]
    assert steady[1] < steady[0]
    judged = judged_order(COST, load_SE, 4, 1, empty)
    assert judged is not None and list(judged.perm_E) == shares and judged.serve == way
    assert judged.saving_s == (now_s - sha_s) / 2


def test_a_running_layer_never_takes_an_order_slower_at_once() -> None:
    """The shares order has the faster table but is slower at once than the empty slots:
    the popular order, faster at once, is taken."""
    load_SE = torch.tensor([[1, 95, 118, 76, 60, 1, 145, 1], [5, 114, 87, 67, 61, 2, 130, 4]])
    empty = _empty(4, 1)
    popular, shares = window_order(load_SE, 4), shared_order(load_SE, 4, 1)
    assert popular is not None and shares is not None
    now_s = serving_s(COST, load_SE, empty)
    assert map_way(COST, relabelled(load_SE, shares), 4, 1)[0] >= now_s
    assert (
        table_way(COST, relabelled(load_SE, shares), 4, 1)[0]
        < table_way(COST, relabelled(load_SE, popular), 4, 1)[0]
    )
    judged = judged_order(COST, load_SE, 4, 1, empty)
    assert judged is not None and list(judged.perm_E) == popular


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
    judged = judged_order(COST, loads_SE, R, slots, serving)
    if judged is not None:
        got = list(judged.perm_E)
        assert sorted(got) == list(range(8)) and judged.saving_s > 0
        moved = loads_SE[:, torch.tensor(got)]
        if running:
            now_s = serving_s(COST, loads_SE, _empty(R, slots))
            assert map_way(COST, moved, R, slots)[0] < now_s
            got_s = table_way(COST, moved, R, slots)[0]
            # of the orders faster at once, none with a faster table
            for perm_E in candidate_orders(loads_SE, R, slots):
                other = relabelled(loads_SE, perm_E)
                if map_way(COST, other, R, slots)[0] < now_s:
                    assert got_s <= table_way(COST, other, R, slots)[0]
        else:
            assert table_way(COST, moved, R, slots)[0] < table_way(COST, loads_SE, R, slots)[0]


# ---- training: judged with no slot kept either way; re-homes by rent or buy ---------------
def test_in_training_both_maps_are_judged_with_no_slot_kept() -> None:
    from moonplan.plan.residency.stale_steps import stale_steps
    from moonplan.plan.residency.target import window_rows

    judged = judged_order(COST, HOT, 4, 2, stale=True)
    assert judged is not None and judged.stale
    got = list(judged.perm_E)
    assert got == popular_order(HOT.sum(0), 4, list(range(16)))
    moved = HOT[:, torch.tensor(got)]
    rows_SRE = window_rows(HOT.sum(0), 3, 4, HOT)
    now_s = stale_steps(COST, rows_SRE, 2, HOT, training=True).best()[0]  # training steps
    assert map_way(COST, HOT, 4, 2, training=True)[0] == now_s
    assert now_s > map_way(COST, moved, 4, 2, training=True)[0]
    assert judged.saving_s == (now_s - map_way(COST, moved, 4, 2, training=True)[0]) / 3


HOT4 = torch.stack([c.sum(0) for c in _trace(4, seed=7)])  # [4, 16], hot experts 0-3


def test_a_stale_offer_is_fit_on_the_older_half_and_scored_on_the_newer() -> None:
    from moonplan.plan.residency.home_choice import stale_offer, window_order
    from moonplan.plan.residency.stale_steps import stale_steps
    from moonplan.plan.residency.target import window_rows

    offer = stale_offer(COST, HOT4, 4, 2)
    assert offer is not None and list(offer.perm_E) == window_order(HOT4[:2], 4) and offer.stale
    newer = HOT4[2:]
    moved = newer[:, torch.tensor(offer.perm_E)]
    now_s, after_s = (map_way(COST, x, 4, 2, training=True)[0] for x in (newer, moved))
    assert offer.saving_s == (now_s - after_s) / 2 > 0  # training steps: the backward too
    assert now_s > map_way(COST, newer, 4, 2)[0]  # ... which the forward alone leaves out
    # the way its steps are served once taken: the newer half's, under the order
    rows_SRE = window_rows(moved.sum(0), 2, 4, moved)
    assert offer.serve == stale_steps(COST, rows_SRE, 2, moved, training=True).best()[1]
    even = torch.full((4, 16), 8, dtype=torch.int64)  # every order is the identity's tie
    assert stale_offer(COST, even, 4, 2) is None
    assert stale_offer(COST, HOT4[:1], 4, 2) is None  # no older half to fit


def test_an_order_fit_to_noise_is_not_offered() -> None:
    """Experts 0 and 1 (both on rank 0) are hot in the older half only, a burst: fit
    there, the order spreads them and looks faster on those steps, but saves nothing on
    the even steps after."""
    from moonplan.plan.residency.home_choice import stale_offer, window_order

    burst = torch.full((4, 16), 8, dtype=torch.int64)
    burst[:2, :2] = 200
    perm = window_order(burst[:2], 4)
    own = burst[:2][:, torch.tensor(perm)]
    in_sample = [map_way(COST, x, 4, 2, training=True)[0] for x in (own, burst[:2])]
    assert in_sample[0] < in_sample[1]  # in sample: faster
    assert stale_offer(COST, burst, 4, 2) is None


def test_a_rehome_is_priced_by_its_moves_link_time() -> None:
    from moonplan.plan.home import home_map
    from moonplan.plan.residency.refill import refill_link_s, rehome_link_s

    identity = list(range(16))
    assert rehome_link_s(COST, identity, 4, 6.0) == 0.0
    swap = [4, 1, 2, 3, 0, *range(5, 16)]  # experts 0 and 4 trade ranks 0 and 1
    fetch_ER = torch.zeros(16, 4, dtype=torch.bool)
    fetch_ER[4, 0] = fetch_ER[0, 1] = True
    one = refill_link_s(COST, fetch_ER, home_map(16, 4))
    assert one > 0
    assert rehome_link_s(COST, swap, 4, 1.0) == one
    assert rehome_link_s(COST, swap, 4, 6.0) == 6.0 * one


def _stale_snapshot(res, loads_SE: torch.Tensor, steps: int, move_bytes: float):
    from moonplan.plan.residency.refill import Snapshot

    R, B = res.R, res.B
    return Snapshot(loads_SE[-1:].repeat(R, 1) // R, _empty(R, B), loads_SE.sum(0),
                    loads_SE.shape[0], steps, loads_SE, True, move_bytes)  # fmt: skip


def test_training_decisions_offer_a_rehome_once_its_rent_reaches_its_price() -> None:
    from moonplan.plan.residency.home_choice import stale_offer
    from moonplan.plan.residency.refill import Residency, rehome_link_s

    res = Residency(4, 16, 2, COST)
    offer = stale_offer(COST, HOT4, 4, 2)
    assert offer is not None
    perm, saving_s = list(offer.perm_E), offer.saving_s
    price_s = rehome_link_s(COST, perm, 4, 6.0)
    steps = int(price_s / saving_s) + 1  # the steps whose rent pays the price
    assert res.judge(_stale_snapshot(res, HOT4, steps, 0.0)).home is None  # no bytes: none
    assert res.home_credit == 0.0
    half = steps // 2
    assert res.judge(_stale_snapshot(res, HOT4, half, 6.0)).home is None  # rent < price
    assert res.home_credit == half * saving_s
    got = res.judge(_stale_snapshot(res, HOT4, steps - half, 6.0))
    assert got.home == offer and got.stale and got.order is None
    assert res.home_credit == 0.0  # bought: the credit returns to 0


def test_a_rehome_keeps_the_decisions_window_relabelled_and_serves_its_offers_way() -> None:
    """Taking the offer: the window's loads stay (relabelled), the rent returns to 0 and
    the steps are served the offer's way; a re-home no judgement chose (a user's order)
    serves by planner calls until the next decision."""
    from moonplan.plan.residency.home_choice import stale_offer
    from moonplan.plan.residency.refill import Decisions, Residency

    res = Residency(4, 16, 2, COST)
    for loads_E in HOT4:
        res.observe(loads_E[None])
    dec = Decisions(res)
    offer = stale_offer(COST, HOT4, 4, 2)
    assert offer is not None and offer.serve != "call"
    dec.home, res.credit, res.home_credit = offer, 1.0, 2.0
    assert dec.take_home() == offer and dec.home is None and dec.take_home() is None
    before_SE = res.window.loads().clone()
    perm = torch.tensor(offer.perm_E)
    dec.relabel(perm, offer)
    assert torch.equal(res.window.loads(), before_SE[:, perm])
    assert res.credit == res.home_credit == 0.0 and dec.since == 0
    assert dec.way(stale=True) == offer.serve and dec.way(stale=False) == "call"
    dec.relabel(torch.arange(15, -1, -1))  # a re-home no judgement chose (a user's order)
    assert dec.way(stale=True) == "call"
    assert torch.equal(res.window.loads(), before_SE[:, perm].flip(1))
