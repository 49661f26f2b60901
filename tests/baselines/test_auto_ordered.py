"""moonplan-auto over a home order (the runtime's ``home_order=``): relabelled counts,
an order from the window before the trace, clear errors."""

from __future__ import annotations

import pytest
import torch

from moonplan.baselines import make_policy
from moonplan.baselines.prehistory import Prehistory
from moonplan.plan.home_order import popular_order
from moonplan.plan.residency.home_choice import judged_order
from moonplan.traces import generate_counts
from tests.plan.choice.costs import rows_only

COST = rows_only(copy_s_intra=1e-4, copy_s_inter=1e-4, plan_s=1e-5)


def _trace(steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Lognormal counts ``[4, 16]`` whose hot experts sit in the first index block."""
    out = []
    for i in range(steps):
        c = generate_counts("lognormal", ranks=4, experts=16, tokens=64, topk=2, sigma=1.0,
                            seed=seed + i)  # fmt: skip
        c[:, :4] *= 4
        out.append(c)
    return out


def _steps(policy, trace):
    return [policy.step(c) for c in trace]


def test_an_order_is_the_plain_policy_on_relabelled_counts():
    order = list(reversed(range(16)))
    trace = _trace(6)
    got = _steps(make_policy("moonplan-auto-ordered", 4, 16, cost=COST, slots=2,
                             home_order=order), trace)  # fmt: skip
    want = _steps(make_policy("moonplan-auto", 4, 16, cost=COST, slots=2),
                  [c[:, order] for c in trace])  # fmt: skip
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.alloc_ER, b.alloc_ER) and a.choice == b.choice


def test_the_identity_order_changes_nothing():
    trace = _trace(5, seed=3)
    got = _steps(make_policy("moonplan-auto-ordered", 4, 16, cost=COST, slots=2,
                             home_order=list(range(16))), trace)  # fmt: skip
    want = _steps(make_policy("moonplan-auto", 4, 16, cost=COST, slots=2), trace)
    assert all(torch.equal(a.alloc_ER, b.alloc_ER) for a, b in zip(got, want, strict=True))


def test_the_profile_order_comes_from_the_window_before_the_trace():
    policy = make_policy("moonplan-auto-ordered", 4, 16, cost=COST, slots=2, placement_window=3)
    assert policy.steps_before() == [(-3, 0)]
    totals_NE = torch.stack([c.sum(0) for c in _trace(3, seed=7)])
    policy.prime(Prehistory(torch.arange(-3, 0), totals_NE))
    assert policy.home_order == judged_order(COST, totals_NE, 4, 2).perm_E  # predicted faster
    assert list(policy.home_order) == popular_order(totals_NE.sum(0), 4, list(range(16)))
    hot = set(range(4))  # the hot block, spread over the ranks by the order
    assert all(len(hot & set(policy.home_order[4 * r : 4 * r + 4])) == 1 for r in range(4))
    policy.step(_trace(1)[0])


def test_a_profile_the_cost_model_does_not_favour_keeps_the_linear_map():
    """One giant expert: the order leaves its rank as busy (as ``rehome("profile")``
    judges it): the policy is auto on the linear map."""
    giant_NE = torch.tensor([[1000] + [1] * 15] * 3)
    policy = make_policy("moonplan-auto-ordered", 4, 16, cost=COST, slots=2, profile=giant_NE)
    assert policy.home_order == tuple(range(16))
    hot_NE = torch.stack([c.sum(0) for c in _trace(3, seed=7)])
    policy = make_policy("moonplan-auto-ordered", 4, 16, cost=COST, slots=2, profile=hot_NE)
    empty_RB = torch.full((4, 2), -1)  # a profile is judged for a layer whose slots are empty
    assert policy.home_order == judged_order(COST, hot_NE, 4, 2, empty_RB).perm_E
    assert policy.home_order != tuple(range(16))


def test_the_profile_is_the_policy_s_own_window():
    """Steps other readers drew (older ones, here reversed popularity) do not move it."""
    mine_NE = torch.stack([c.sum(0) for c in _trace(3, seed=7)])
    older_NE = mine_NE.flip(1) * 10
    alone = make_policy("moonplan-auto-ordered", 4, 16, cost=COST, placement_window=3)
    alone.prime(Prehistory(torch.arange(-3, 0), mine_NE))
    union = make_policy("moonplan-auto-ordered", 4, 16, cost=COST, placement_window=3)
    union.prime(Prehistory(torch.tensor([-9, -8, -7, -3, -2, -1]), torch.cat([older_NE, mine_NE])))
    assert union.home_order == alone.home_order


def test_plain_auto_ignores_a_home_order_option():
    """``make_policy`` passes an option only to the policies that declare it."""
    policy = make_policy("moonplan-auto", 4, 16, cost=COST, home_order=list(range(16)))
    assert policy.home_order is None


@pytest.mark.parametrize(
    ("order", "match"),
    [([0, 0, *range(2, 16)], "once"), ("popular", "permutation"), (list(range(15)), "once")],
)
def test_bad_orders_are_named(order, match):
    with pytest.raises(Exception, match=match):
        make_policy("moonplan-auto-ordered", 4, 16, cost=COST, home_order=order)


def test_a_profile_order_needs_the_window_before():
    policy = make_policy("moonplan-auto-ordered", 4, 16, cost=COST)
    with pytest.raises(ValueError, match="needs prime"):
        policy.step(_trace(1)[0])


def test_auto_rehomes_by_itself_from_its_window_while_serving():
    """The runtime's ``MoEConfig.rehome``: auto takes the order its window favours (as
    ``rehome("profile")`` judges it); not where the slots go stale (training), nor with
    ``rehome=False``; without a window it keeps the linear map."""
    totals_NE = torch.stack([c.sum(0) for c in _trace(3, seed=7)])
    before = Prehistory(torch.arange(-3, 0), totals_NE)
    want = judged_order(COST, totals_NE, 4, 2).perm_E  # before the trace: best tables
    for options, order in (({}, want), ({"stale_slots": True}, None), ({"rehome": False}, None)):
        policy = make_policy("moonplan-auto", 4, 16, cost=COST, slots=2, placement_window=3,
                             **options)  # fmt: skip
        assert policy.steps_before() == [(-3, 0)]
        policy.prime(before)
        assert policy.home_order == order, options
        policy.step(_trace(1)[0])


@pytest.mark.parametrize(("slots", "moves"), [(0, True), (2, False)])
def test_without_a_window_before_auto_rehomes_after_its_first_window(slots, moves):
    """No steps before the trace: the linear map for ``placement_window`` steps, then
    the order judged against the slots serving then (none: taken; the replicas auto
    copied into 2 slots already serve better: the map stays), once."""
    trace = _trace(6, seed=7)
    policy = make_policy("moonplan-auto", 4, 16, cost=COST, slots=slots, placement_window=3,
                         staging=0)  # fmt: skip
    loads_SE = torch.stack([c.sum(0) for c in trace[:3]])
    for c in trace[:3]:
        policy.step(c)
        assert policy.home_order is None
    serving_RB = policy.serving.slot_expert.clone()
    policy.step(trace[3])
    want = judged_order(COST, loads_SE, 4, slots, serving_RB)
    assert (want is not None) == moves and not policy.rehome  # judged once
    policy.step(trace[4])
    assert policy.home_order == (want.perm_E if moves else None)


def test_in_training_auto_rehomes_where_its_decisions_rent_or_buy_says_and_pays_the_move():
    """Stale slots (training): no re-home of its first window; its decisions' rent or buy
    (``Residency``) offers one, taken between two steps, the next step charged the rows'
    link time at ``TRAINING_MOVE_BYTES``, the decisions' window kept (relabelled) and the
    offer's way serving; ``reset()`` undoes it; ``rehome=False``: never."""
    from moonplan.baselines.policies import TRAINING_MOVE_BYTES
    from moonplan.plan.residency.refill import rehome_link_s

    trace = _trace(40, seed=7)
    runs = {}
    for rehome in (True, False):
        policy = make_policy("moonplan-auto", 4, 16, cost=COST, slots=2, placement_window=3,
                             stale_slots=True, rehome=rehome)  # fmt: skip
        charged, orders, held, ways = [], [], [], []
        for c in trace:
            charged.append(policy.step(c).blocking_s)
            orders.append(policy.home_order)
            held.append(policy.residency.window.filled)
            ways.append(policy.decisions.way(stale=True))
        runs[rehome] = (charged, orders)
        policy.reset()
        assert policy.home_order is None and policy._blocking_s == 0.0
    charged, orders = runs[True]
    first = next(i for i, o in enumerate(orders) if o is not None)  # taken after step first
    assert first > 3  # from its decisions, not at its first window
    want_s = rehome_link_s(COST, list(orders[first]), 4, TRAINING_MOVE_BYTES)
    assert charged[first + 1] == want_s > 0 and set(charged[: first + 1]) == {0.0}
    assert held == [1, 2] + [3] * 38  # the window's loads stay through the re-home
    assert ways[first] != "call"  # the offer's way (judged for its steps under the order)
    assert runs[False] == ([0.0] * 40, [None] * 40)
