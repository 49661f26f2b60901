"""Which experts the slots should hold: replica counts, packing and the cost model's table."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moonplan.plan.choice.rent import exit_rent
from moonplan.plan.home import home_list
from moonplan.plan.residency.serving import LOOKUPS, WEIGHTED
from moonplan.plan.residency.target import (
    calls_share,
    mean_step,
    pack,
    replica_counts,
    resident_over,
    served_s,
    step_time_over,
    table_ways,
    target_of,
    whole_moves,
    window_rows,
    window_s,
)
from moonplan.plan.residency.weighted_way import crossed_shares, window_shares
from tests.plan.choice.costs import rows_only, tiles_costs


def test_replicas_go_to_the_most_records_per_holder() -> None:
    assert replica_counts([100, 10, 0, 40], 4, 3) == [3, 1, 1, 2]  # 100 -> 50 -> 40 -> 33
    assert replica_counts([100, 0], 2, 5) == [2, 1]  # at most R holders, none for no records
    assert replica_counts([5, 5], 4, 0) == [1, 1]


def test_pack_keeps_residents_in_place_and_never_doubles_or_homes() -> None:
    E, R, B = 8, 4, 2
    home = home_list(E, R)
    n = [3, 1, 2, 1, 1, 1, 1, 2]
    totals = [90, 5, 40, 5, 5, 5, 5, 30]
    current = [[-1, -1], [-1, 0], [-1, -1], [-1, -1]]  # expert 0 already on rank 1, slot 1
    slots = pack(n, totals, B, current)
    assert slots[1][1] == 0  # the resident stays where it is
    for r, row in enumerate(slots):
        held = [e for e in row if e >= 0]
        assert len(held) == len(set(held)) and all(home[e] != r for e in held)
    flat = [e for row in slots for e in row if e >= 0]
    assert sorted(flat) == [0, 0, 2, 7]  # n - 1 of each


def test_mean_step_spreads_each_experts_mean_over_the_sources() -> None:
    got = mean_step(torch.tensor([20, 7, 0]), 2, 3)  # means 10, 3, 0
    assert got.sum(0).tolist() == [10, 3, 0] and got[:, 0].tolist() == [4, 3, 3]


def test_mean_step_spreads_the_remainders_over_every_source() -> None:
    """Decode sizes: 896 experts of 18 records on 64 ranks. Each expert's 18 records go
    to 18 ranks, from its own index on, so every rank sends 896 * 18 / 64 = 252 (the first
    ranks used to send one record of every expert: 896 on ranks 0-17, none elsewhere)."""
    got = mean_step(torch.full((896,), 18), 1, 64)
    assert got.sum(0).tolist() == [18] * 896 and got.sum(1).tolist() == [252] * 64


def test_the_table_replicates_a_persistent_hot_expert_only_where_it_pays() -> None:
    R = 4
    totals = torch.tensor([4000, 100, 100, 100, 100, 100, 100, 100])
    empty = torch.full((R, 2), -1, dtype=torch.int64)
    t = target_of(totals, 10, empty, rows_only()).slot_RB
    assert int((t == 0).sum()) >= 2  # the hot expert, on several ranks
    dear = rows_only(weight_read_s=1.0)  # a replica's weight read outweighs any balance
    assert bool((target_of(totals, 10, empty, dear).slot_RB == -1).all())
    # serving replicas through calls is dear (each exit builds the resident plan, a round
    # costs 1 s): the hot expert's replicas serve by the weighted lookup, no call, whose
    # shares are uneven: its home (with the least else to run) takes the most of it
    # (over ten steps: its shares are scored on steps they were not fit on, and with one
    # step there is none, so it is no way then and the even split serves)
    dear_calls = rows_only(copy_s_intra=1.0, copy_s_inter=1.0, round_s=1.0)
    assert target_of(totals, 10, empty, dear_calls).serve == "split"
    loads_SE = (totals // 10).expand(10, -1)
    got = target_of(totals, 10, empty, dear_calls, loads_SE)
    assert got.serve == WEIGHTED and int((got.slot_RB == 0).sum()) >= 2
    rows_SRE = window_rows(totals, 10, R, loads_SE)
    w_R = window_shares(dear_calls, rows_SRE, got.slot_RB[None])[0, 0]
    assert bool((w_R > 0).all()) and int(w_R.argmax()) == 0 and len(set(w_R.tolist())) > 1


def test_calls_that_cannot_pay_leave_static_ep_serving() -> None:
    """Even loads and a planner call dearer than any imbalance: no table and no call;
    with the call free the same loads keep calls (nothing is lost by calling)."""
    R = 4
    totals = torch.full((8,), 400)
    empty = torch.full((R, 2), -1, dtype=torch.int64)
    got = target_of(totals, 10, empty, rows_only(exit_s=1.0, plan_s=1.0))
    assert got.serve in LOOKUPS and bool((got.slot_RB == -1).all())
    assert target_of(totals, 10, empty, rows_only(exit_s=0.0, plan_s=0.0)).serve in LOOKUPS
    hot = torch.tensor([4000, 100, 100, 100, 100, 100, 100, 100])
    assert target_of(hot, 10, empty, rows_only(exit_s=0.0, plan_s=0.0)).serve == "call"


def test_whole_moves_take_experts_off_the_longest_rank() -> None:
    """Decode-like costs (a weight read is worth 100 rows): rank 0 reads three busy home
    experts, rank 1 one. Moving one of rank 0's to rank 1 makes it two against two reads;
    a second move would only swap the longest rank, and it stops. A moved expert the
    serving table holds on the same rank keeps its slot."""
    cost = rows_only(row_flop_s=0.0, row_mem_s=1e-8, weight_read_s=1e-6)
    counts = np.array([[5, 6, 7, 0, 0, 0, 8, 0]] * 2)  # E = 8, R = 2: homes 0-3 and 4-7
    got = whole_moves(cost, counts, 2, [[-1, -1], [-1, -1]])
    assert got == [[-1, -1], [0, -1]]  # the fewest rows: the longer of the two least
    assert whole_moves(cost, counts, 2, [[-1, -1], [-1, 0]]) == [[-1, -1], [-1, 0]]
    assert whole_moves(cost, counts, 0, [[], []]) == [[], []]  # no slot, no move


def test_tables_are_scored_on_the_windows_steps_not_their_mean() -> None:
    """Two hot experts of rank 0 (homes 0, 1; rank 1 homes 2, 3), only rows cost. Steady,
    moving expert 1 to rank 1 halves the busiest rank against static EP. Taking turns (the
    same mean step), the moved expert helps on one step of two and replicas of both on
    every step: the mean step cannot tell them apart, the window's steps can, and the
    target keeps the replicas."""
    cost = rows_only()
    moves = np.array([[-1, -1], [1, -1]])
    replicas = np.array([[-1, -1], [0, 1]])
    none = np.full((2, 2), -1)
    steady = torch.tensor([[50, 50, 0, 0], [50, 50, 0, 0]])
    turns = torch.tensor([[100, 0, 0, 0], [0, 100, 0, 0]])
    mean = mean_step(turns.sum(0), 2, 2)
    assert served_s(cost, mean, moves) == served_s(cost, mean, replicas)

    def over(loads_SE: torch.Tensor, table: np.ndarray) -> float:
        rows = [mean_step(l_E, 1, 2) for l_E in loads_SE]
        statics = [step_time_over(cost, c_RE, none) for c_RE in rows]
        return window_s(cost, rows, statics, table)

    assert over(steady, moves) < over(steady, none) and over(turns, moves) < over(turns, none)
    assert over(turns, replicas) < over(turns, moves)
    got = target_of(turns.sum(0), 2, torch.from_numpy(none), cost, turns).slot_RB
    assert sorted(got.flatten().tolist()) == [-1, -1, 0, 1]  # both replicated on rank 1
    assert got[0].tolist() == [-1, -1]


def test_a_table_is_charged_the_planning_auto_would_spend_on_it() -> None:
    """The exit's test (and each round of the resident build with replicas) where the plan
    passes the exit's bound, a full call where it does not."""
    R, E = 4, 8
    counts = np.full((R, E), 10, dtype=np.int64)
    counts[:, 0] = 400  # a hot expert: static EP is slow, copies are free
    empty = np.full((R, 2), -1, dtype=np.int64)
    cost = rows_only(plan_s=1e-4, exit_s=1e-5)  # rows 1e-6 s: static EP takes 1.64e-3 s
    static = step_time_over(cost, counts, empty)
    assert served_s(cost, counts, empty) == static + 1e-4  # a copy could pay
    dear = rows_only(plan_s=1e-4, exit_s=1e-5, round_s=2e-5, copy_s_intra=1.0, copy_s_inter=1.0)
    assert served_s(dear, counts, empty) == static + 1e-5  # none can pay
    held = empty.copy()
    held[1:, 0] = 0  # the hot expert resident on every other rank
    res = step_time_over(dear, counts, held)
    assert res < static and served_s(dear, counts, held) == res + 1e-5 + 2e-5  # built, 1 round
    cheap = dear.scaled(round_s=1e-9)  # a round pays for a thousandth of a row: many run
    res, rounds = resident_over(cheap, counts, held)
    assert rounds > 1 and served_s(cheap, counts, held) == res + (1e-5 + rounds * 1e-9)


@pytest.mark.parametrize("over", [1.1e-6, 3e-6, 3.3e-6, 1.1e-5, 4e-5])
def test_the_calls_share_is_what_the_exit_spends_on_a_steady_run(over: float) -> None:
    """Steps ``over`` above the exit's bound, a call ``checking`` dearer than the test: the
    planning ``rent.exit_rent`` spends over a long run, step by step, averages
    :func:`calls_share` (one call per ``ceil(checking / over)`` steps; no ratio drawn here is
    a whole number, where float sums could land on either side)."""
    exit_s, plan_s = 2e-6, 1.2e-5
    checking, pending, spent, steps = plan_s - exit_s, 0.0, 0.0, 0
    t, bound = 1e-4 + over, 1e-4
    while steps < 60 or pending:  # whole cycles: end just after a call
        exited, _, pending = exit_rent(t, 0.0, (bound, math.inf), (-math.inf, pending), checking)
        spent, steps = spent + (exit_s if exited else plan_s), steps + 1
    share = calls_share(t - bound, checking, exit_s, plan_s)
    assert spent / steps == pytest.approx(share)
    assert exit_s < share <= plan_s


def test_a_table_is_scored_on_the_faster_rounding_of_the_resident_plan() -> None:
    """``step_time_over`` times the ``resident`` candidate as ``auto`` builds it: in whole
    tiles where compute alone costs (one tile a rank), in records where only the links do
    (nothing sent); ``test_choice.py`` has the same hand case."""
    counts = np.array([[2, 0], [1, 1]])  # test_choice.TILES_CASE
    held = np.array([[-1], [0]])  # expert 0 (home rank 0) resident on rank 1
    compute, links = tiles_costs()
    assert step_time_over(compute, counts, held) == 16e-6  # records: rank 1 runs two tiles
    assert step_time_over(links, counts, held) == 0.0  # whole tiles: rank 1 sends one row


def test_the_weighted_lookup_is_scored_on_steps_its_shares_were_not_fit_on() -> None:
    """Each step's weighted lookup is scored with shares fit on the other half of the
    window (even steps with the odd steps' mean, and back), and with one step it is no
    way at all: shares fit on the step they are scored on predict it too well."""
    R, E = 4, 8
    g = torch.Generator().manual_seed(4)
    rows_SRE = torch.randint(0, 40, (6, R, E), generator=g)
    rows_SRE[:, :, 0] += 100
    slot_TRB = torch.tensor([[[-1, -1], [0, -1], [0, -1], [0, -1]]])
    cost = rows_only()
    got = crossed_shares(cost, rows_SRE, slot_TRB)
    assert torch.equal(got[0], window_shares(cost, rows_SRE[1::2], slot_TRB))
    assert torch.equal(got[1], window_shares(cost, rows_SRE[0::2], slot_TRB))
    with pytest.raises(ValueError, match="other steps"):
        crossed_shares(cost, rows_SRE[:1], slot_TRB)
    ways = [w for _, w in table_ways(cost, rows_SRE[:1], slot_TRB)]
    assert WEIGHTED not in ways
    # over an empty table every lookup is static EP: the first of them, never the weighted
    empty_1RB = torch.full((1, R, 2), -1, dtype=torch.int64)
    assert table_ways(rows_only(exit_s=1.0, plan_s=1.0), rows_SRE, empty_1RB)[0][1] == "placed"


def test_the_window_scores_the_weighted_lookup_with_crossed_shares() -> None:
    """The weighted lookup's score over the window is ``lookups_torch`` with the crossed
    shares (fit on the other half), not with shares fit on the steps scored; a table
    without replicas scores static EP for every lookup."""
    from moonplan.plan.residency.target import _lookups
    from moonplan.plan.residency.window_torch import lookups_torch, static_torch

    R, E = 4, 8
    g = torch.Generator().manual_seed(5)
    rows_SRE = torch.randint(0, 40, (6, R, E), generator=g)
    rows_SRE[:, :, 0] += torch.randint(50, 150, (6, 1), generator=g)
    slot_TRB = torch.tensor([[[-1, -1], [0, -1], [0, -1], [0, -1]], [[-1, -1]] * R])
    cost = rows_only()
    static_S = static_torch(cost, rows_SRE)
    got_LTS = _lookups(cost, rows_SRE, slot_TRB, static_S, None)
    crossed = crossed_shares(cost, rows_SRE, slot_TRB[:1])
    want_LS = lookups_torch(cost, rows_SRE, slot_TRB[:1], None, crossed)[:, 0]
    assert torch.equal(got_LTS[:, 0], want_LS)
    fit_here = window_shares(cost, rows_SRE, slot_TRB[:1])[None].expand(6, -1, -1, -1)
    in_sample_S = lookups_torch(cost, rows_SRE, slot_TRB[:1], None, fit_here)[-1, 0]
    assert float(in_sample_S.sum()) < float(got_LTS[-1, 0].sum())  # it flatters itself
    assert torch.equal(got_LTS[:, 1], static_S[None].expand(len(got_LTS), -1))
