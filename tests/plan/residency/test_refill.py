"""When a refill pays: the staging limit, the swap, rent or buy, and a steady or moving hot set."""

from __future__ import annotations

import pytest
import torch

from moonplan.plan.residency.refill import (
    Refill,
    Residency,
    changed_pairs,
    limit_changes,
    refill_link_s,
    swapped_slots,
)
from moonplan.plan.residency.serving import LOOKUPS
from moonplan.plan.residency.work import Builds
from tests.plan.choice.costs import rows_only
from tests.plan.draw import hot_steps as draw_hot


def test_limit_changes_keeps_at_most_the_staging_rows_and_never_empties() -> None:
    current = torch.tensor([[1, 2, -1], [0, -1, -1]])
    target = torch.tensor([[3, -1, 4], [5, 6, 7]])
    totals = torch.tensor([0, 0, 0, 10, 50, 1, 30, 20])
    got = limit_changes(target, current, 1, totals)
    assert got.tolist() == [[1, 2, 4], [0, 6, -1]]  # the most records first; -1 keeps
    assert limit_changes(target, current, 3, totals).tolist() == [[3, 2, 4], [5, 6, 7]]
    assert changed_pairs(got, current, 8).nonzero().tolist() == [[4, 0], [6, 1]]


def test_the_swap_empties_a_twin_a_step_put_elsewhere() -> None:
    last = torch.tensor([[7, 3, -1]])  # a step's plan copied expert 3 into slot 1 meanwhile
    order = Refill(torch.tensor([[7, 5, 3]]), torch.tensor([[False, False, True]]),
                   torch.zeros(8, 1, dtype=torch.bool))  # fmt: skip
    slots, changed = swapped_slots(last, order)
    assert slots.tolist() == [[7, -1, 3]] and changed.tolist() == [[False, False, True]]


def test_link_time_of_no_copy_is_zero() -> None:
    assert refill_link_s(rows_only(), torch.zeros(4, 2, dtype=torch.bool), torch.zeros(4)) == 0


def hot_steps(steps: int, hot: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    """Counts ``[4, 16]``: a persistent hot set over noise."""
    return draw_hot(steps, 4, 16, hot, low=5, high=15, extra=120, seed=seed)


def run(
    res: Residency, trace: list[torch.Tensor], slots: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """Steps ``trace`` through ``res`` with a refill served as soon as it is ordered;
    the copies each step made and the slots serving at the end."""
    copies = []
    for c in trace:
        res.observe(c)
        order = res.decide(c, slots)
        copies.append(0 if order is None else int(order.fetch_ER.sum()))
        if order is not None:
            slots = order.slot_RB
    return copies, slots


def test_a_steady_hot_set_is_placed_once_then_left_alone() -> None:
    """Rent or buy with the copies' link time as price: the hot experts are placed within a
    few steps, then (the popularity steady) at most 0.05 copies per rank and step."""
    cost = rows_only(copy_s_intra=1e-4, copy_s_inter=1e-4)
    res = Residency(4, 16, 2, cost, window=8)
    empty = torch.full((4, 2), -1, dtype=torch.int64)
    copies, held = run(res, hot_steps(200, (0, 5)), empty)
    assert {0, 5} <= set(held[held >= 0].tolist())
    assert sum(copies[:20]) > 0
    assert sum(copies[20:]) / (180 * 4) <= 0.05


def test_a_moved_hot_set_is_followed_within_a_window() -> None:
    """The slots follow a moved hot set within a window. (The exact way is made dear: free,
    as the other calls are here, it is near the ideal from any slots, and the rent of
    moving them accrues slowly; ``test_target`` tests that choice.)"""
    cost = rows_only(copy_s_intra=1e-4, copy_s_inter=1e-4, exact_s=1.0)
    W = 8
    res = Residency(4, 16, 2, cost, window=W)
    empty = torch.full((4, 2), -1, dtype=torch.int64)
    _, before = run(res, hot_steps(40, (0, 5)), empty)
    copies, held = run(res, hot_steps(3 * W, (10, 14), seed=1), before)
    assert {10, 14} & set(held[held >= 0].tolist())
    first = next(i for i, n in enumerate(copies) if n)
    assert first <= W  # the window follows within W steps, the rent pays soon after


def test_staging_must_be_a_positive_integer() -> None:
    with pytest.raises(ValueError, match="staging"):
        Residency(4, 16, 2, rows_only(), staging=0)


def test_each_table_serves_the_way_judged_for_it() -> None:
    """The verdict's way is the serving table's best over the window, the refill's the
    best of the table it brings (staging limit included), each from ``table_ways``; and
    the rent compares the two tables each served its own way. (The exact way, which keeps
    no table, is made dear here: ``test_target`` tests it.)"""
    from moonplan.plan.residency.target import table_ways, window_rows

    W, B = 8, 2
    trace = hot_steps(W, (0, 5))
    seen = set()
    for exit_s, plan_s in ((0.0, 0.0), (1e-4, 1e-4)):  # calls free, calls dear
        cost = rows_only(copy_s_intra=1e-9, copy_s_inter=1e-9, exit_s=exit_s, plan_s=plan_s,
                         exact_s=1.0)  # fmt: skip
        res = Residency(4, 16, B, cost, window=W)
        for c in trace:
            res.observe(c)
        for serving in (torch.full((4, B), -1), torch.tensor([[4, 8], [0, 12], [1, 13], [2, 9]])):
            snap = res.snapshot(trace[-1], serving)
            verdict = res.judge(snap)
            rows = window_rows(snap.totals_E, snap.filled, 4, snap.loads_SE)
            assert verdict.serve == table_ways(cost, rows, serving[None])[0][1]
            assert verdict.order is not None  # copies nearly free: the rent pays at once
            assert verdict.order.serve == table_ways(cost, rows, verdict.order.slot_RB[None])[0][1]
            seen |= {verdict.serve, verdict.order.serve}
    assert "call" in seen and seen & set(LOOKUPS)  # both kinds of way were judged


def test_the_way_changes_when_the_refill_arrives() -> None:
    """Until its refill arrives the slots serve the way judged for them; the refill's
    table then serves its own; a table no decision judged serves by planner calls."""
    import moonplan
    from moonplan.plan.residency.refill import Decisions, Verdict

    res = Residency(4, 16, 2, rows_only(), window=4)
    table = torch.tensor([[5, -1], [0, -1], [-1, -1], [-1, -1]])
    order = Refill(table, table >= 0, torch.zeros(16, 4, dtype=torch.bool), "split")
    res.judge = lambda snap, builds=None: Verdict(order, "placed")  # type: ignore[method-assign]
    d = Decisions(res)
    got = None
    for c in hot_steps(4, (0, 5)):
        got = got or d.step(c, moonplan.plan(c, slots=2, policy="static"), busy=False)
    assert got is order and d.serve == "placed"  # the old slots, their own way
    d.arrived(table.clone())
    assert d.serve == "split"  # the refill's table, its way
    d.arrived(torch.full((4, 2), -1))
    assert d.serve == "call"  # judged by no decision


def test_a_way_judged_for_stale_steps_serves_only_stale_steps() -> None:
    """A decision from a step whose slots went stale (training) orders no refill and
    judges the way of such steps; steps whose slots stay are served by calls until a
    decision judges theirs, and the other way round."""
    import moonplan
    from moonplan.plan.residency.refill import Decisions

    cost = rows_only(copy_s_intra=1e-9, copy_s_inter=1e-9, exit_s=1e-3, plan_s=1e-3,
                     exact_s=1e-9, decide_s=1e-12, score_s=1e-12)  # fmt: skip
    d = Decisions(Residency(4, 16, 2, cost, window=4))
    for c in hot_steps(4, (0, 5)):
        assert d.step(c, moonplan.plan(c, slots=2, policy="static"), False, stale=True) is None
    assert d.way(stale=True) == "exact" and d.way(stale=False) == d.serve == "call"
    for c in hot_steps(4, (0, 5), seed=1):
        d.step(c, moonplan.plan(c, slots=2, policy="static"), False)
    assert d.way(stale=True) == "call"


def test_decisions_are_used_a_lag_later_and_alike_inline_or_on_a_worker() -> None:
    """A decision starts from one step's snapshot and its answer is used ``due`` steps
    later; on a worker thread (the runtime) or inline (the simulator) the orders come at
    the same steps with the same tables."""
    from concurrent.futures import ThreadPoolExecutor

    import moonplan
    from moonplan.plan.residency.refill import Decisions

    cost = rows_only(copy_s_intra=1e-4, copy_s_inter=1e-4)
    trace = hot_steps(30, (0, 5))
    runs = []
    with ThreadPoolExecutor(1) as worker:
        for submit in (None, worker.submit):
            d = Decisions(Residency(4, 16, 2, cost.scaled(decide_s=1e-6), window=8), submit)
            got = []
            for t, c in enumerate(trace):
                p = moonplan.plan(c, slots=2, policy="static")
                order = d.step(c, p, busy=False)
                if order is not None:
                    got.append((t, order.slot_RB.tolist()))
            runs.append(got)
    assert runs[0] == runs[1] and runs[0]
    assert runs[0][0][0] >= 1  # never at the step whose snapshot it read


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decisions_on_cuda_counts_order_as_on_the_host() -> None:
    """With the window on a GPU, a decision scores on the device (on a worker: a side
    stream) and orders the same tables at the same steps as on the host, counting the
    same work."""
    from concurrent.futures import ThreadPoolExecutor

    import moonplan
    from moonplan.plan.residency.refill import Decisions

    cost = rows_only(copy_s_intra=1e-4, copy_s_inter=1e-4)
    trace = hot_steps(30, (0, 5))
    runs = []
    with ThreadPoolExecutor(1) as worker:
        for dev, submit in (("cpu", None), ("cuda", None), ("cuda", worker.submit)):
            res = Residency(4, 16, 2, cost.scaled(decide_s=1e-6), window=8,
                            device=torch.device(dev))  # fmt: skip
            d = Decisions(res, submit)
            got = []
            for t, c in enumerate(trace):
                c = c.to(dev)
                order = d.step(c, moonplan.plan(c, slots=2, policy="static"), busy=False)
                if order is not None:
                    got.append((t, order.slot_RB.tolist()))
            runs.append(got)
    assert runs[0] == runs[1] == runs[2] and runs[0]


def test_a_decision_counts_the_work_it_does() -> None:
    """A decision counts a build for each ``resident`` plan it makes (the host's
    ``resident_over`` calls, and the window's entries the exit's gate let through, built
    in one ``built_s`` call), and a scored pair for each (step, table) it scores: static
    EP's and every table's over the window (the empty table once), each table's lookups
    over it (the weighted one too; none over a table without replicas: static EP), and
    the rent's two host scores (``served_s``, or a table's lookups each); and a build for
    each plan of the exact way's chain."""
    from unittest import mock

    from moonplan.plan.residency import refill, target, window_torch

    cost = rows_only(copy_s_intra=1e-4, copy_s_inter=1e-4)
    W, B = 8, 2
    res = Residency(4, 16, B, cost, window=W)
    trace = hot_steps(W, (0, 5))
    for c in trace:
        res.observe(c)
    empty = torch.full((4, B), -1, dtype=torch.int64)
    builds = Builds()
    wrap = mock.patch.object
    with (
        wrap(target, "resident_over", wraps=target.resident_over) as a,  # every host build
        wrap(target, "windows_torch", wraps=target.windows_torch) as w,
        wrap(target, "static_torch", wraps=target.static_torch) as s,
        wrap(window_torch, "built_s", wraps=window_torch.built_s) as built,
        wrap(refill, "served_s", wraps=refill.served_s) as served,
        wrap(target, "lookups_torch", wraps=target.lookups_torch) as looked,
        wrap(refill, "lookups_torch", wraps=refill.lookups_torch) as rent_looked,
        wrap(target, "exact_steps_s", wraps=target.exact_steps_s) as chain,
        wrap(refill, "exact_steps_s", wraps=refill.exact_steps_s) as rent_chain,
    ):
        res.decide_on(res.snapshot(trace[-1], empty), builds)
    # the candidates (and the serving table) in one call, the refill's table in another
    # where the staging limit stops short of the target
    assert s.call_count == w.call_count >= looked.call_count and 1 <= s.call_count <= 2
    tables = [len(call.args[3]) for call in w.call_args_list]
    entries = sum(len(call.args[1]) for call in built.call_args_list)
    assert built.call_count <= len(tables) and entries >= 1  # the gate let some through
    exact = sum(len(c.args[1]) for c in chain.call_args_list + rent_chain.call_args_list)
    assert chain.call_count == 1 and exact >= W  # the exact way's chain: a build a step
    assert builds.made == a.call_count + entries + exact
    L = len(LOOKUPS) + 1  # and the weighted lookup
    weighted = [len(c.args) > 4 and c.args[4] is not None for c in rent_looked.call_args_list]
    rent = served.call_count + sum(len(LOOKUPS) + w for w in weighted)  # one step and table
    held = sum(len(c.args[2]) for c in looked.call_args_list)  # tables with replicas
    assert builds.scored == sum(W * t + W for t in tables) + L * W * held + rent
    assert entries <= W * sum(tables)


def test_an_answer_waits_for_the_steps_its_counted_work_covers() -> None:
    """A decision is used no earlier than the steps whose predicted time covers its builds,
    even where the previous decision's lag guessed fewer; then that count is the next
    guess. Inline and on a worker alike."""
    import math
    from concurrent.futures import ThreadPoolExecutor

    import moonplan
    from moonplan.plan.plan_time import plan_time
    from moonplan.plan.residency.refill import Decisions

    cost = rows_only(copy_s_intra=1e-4, copy_s_inter=1e-4)
    trace = hot_steps(60, (0, 5))
    p = moonplan.plan(trace[0], slots=2, policy="static")
    step_s = plan_time(cost, p, planned=0).total_s
    seen = []
    with ThreadPoolExecutor(1) as worker:
        for submit in (None, worker.submit):
            build_s = 2.5 * step_s  # a build: 2.5 steps
            res = Residency(4, 16, 2, cost.scaled(decide_s=build_s), window=4)
            d = Decisions(res, submit)
            made = []
            judge = res.judge

            def counted(snap, builds=None, judge=judge, made=made):  # type: ignore[no-untyped-def]
                out = judge(snap, builds)
                made.append(builds.made if isinstance(builds, Builds) else 0)
                return out

            res.judge = counted  # type: ignore[method-assign]
            for c in trace:
                d.step(c, p, busy=False)
                if made and d._pending is None:
                    break
            assert d.due == math.ceil(made[0] * build_s / step_s)
            assert d.since == d.due and d.due > 1  # used at the step its work covers
            seen.append(d.due)
    assert seen[0] == seen[1]


def test_a_decision_is_charged_the_hosts_rates_and_the_devices_without_them() -> None:
    from moonplan.plan.residency.refill import time_decision, time_rates
    from moonplan.plan.residency.work import build_rate, score_rate, work_s

    cost = rows_only(exit_s=2e-6)
    assert build_rate(cost) == score_rate(cost) == 2e-6  # not measured: the device's rate
    timed = cost.scaled(decide_s=3e-3, score_s=5e-4)
    assert (build_rate(timed), score_rate(timed)) == (3e-3, 5e-4)
    assert work_s(timed, Builds(made=2, scored=10)) == 2 * 3e-3 + 10 * 5e-4
    counts = hot_steps(1, (0, 5))[0]
    build_s, score_s = time_rates(cost, counts, 2, repeats=3)
    assert 0 < score_s < 1.0 and 0 < build_s < 1.0  # host seconds, timed here
    seconds, work = time_decision(cost, [counts] * 32, 2, repeats=3)
    charged = work.made * build_s + work.scored * score_s
    assert 0.3 < charged / seconds < 3.0  # scaled to a decision's time (timing noise)


@pytest.mark.parametrize("copy_s", [1e-6, 1e-4])
@pytest.mark.parametrize("exact_s", [1e-7, 1e-5])
@pytest.mark.parametrize(("low", "high", "extra"), [(0, 15, 120), (5, 100, 300)])
def test_the_primed_table_serves_the_way_a_decision_judges_for_it_kept(
    copy_s, exact_s, low, high, extra
) -> None:
    """Before the trace the table is placed from empty slots (``target_of``); its way is
    the one a decision over the same window judges for that table kept, the exact kernel
    from it included (``Target.kept``). With copies dear and the exact kernel cheap
    (``1e-4``, ``1e-5``, loads 0-15), that is the exact way, where the table's best way
    alone (the weighted lookup) was primed before, though the first decision then chose
    the exact kernel."""
    from moonplan.plan.residency.serving import empty_slots
    from moonplan.plan.residency.target import target_of
    from tests.plan.draw import hot_steps as draw

    trace = draw(8, 4, 16, (0, 5), low=low, high=high, extra=extra, seed=1)
    cost = rows_only(copy_s_intra=copy_s, copy_s_inter=copy_s, exit_s=1e-4, plan_s=1e-4,
                     exact_s=exact_s)  # fmt: skip
    res = Residency(4, 16, 2, cost, window=8)
    placed_RB = res.prime(torch.stack([c.sum(0) for c in trace]))
    loads_SE = res.window.loads()
    kept = target_of(loads_SE.sum(0), 8, placed_RB, cost, loads_SE).kept
    assert res.primed.serve == kept
    if (copy_s, exact_s, low) == (1e-4, 1e-5, 0):
        alone = target_of(loads_SE.sum(0), 8, empty_slots(4, 2), cost, loads_SE)
        assert (alone.serve, kept) == ("weighted", "exact")
