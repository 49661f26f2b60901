"""Which experts the slots should hold: the replica set the cost model prefers over a window.

Legend:
    R ranks    E experts    B slots per rank    k replicas per rank (``0 .. B``)
    totals_E   int64 ``[E]`` records per expert over the window's steps
    slot_RB    int64 ``[R, B]`` the expert in each slot (``-1``: empty)
    mean_RE    int64 ``[R, E]`` the window's mean step, each expert's records spread
               evenly over the source ranks

For each ``k`` from 0 to ``B`` a candidate table holds ``k * R`` replicas:

1. **How many of each expert** (:func:`replica_counts`): one replica at a time to the
   expert with the most records per holder (its home counts as one), none beyond ``R``
   holders or to an expert without records.
2. **Where** (:func:`pack`): the current slots keep the replicas the new counts still
   want, in place (a resident is not moved); the others go, largest share first, to the
   rank with a free slot, not holding the expert, and the least expected records (each
   expert's records split evenly over its holders).

The table chosen is the one with the least predicted step time on the window's mean step
(ties: fewer replicas), as ``auto`` would plan it (:func:`served_s`): the better of static
EP and the ``resident`` plan (``moonplan.plan.choice.resident``, the plan each step makes
inside the slots), charged the planning it costs: the early exit's test, and ``serve_s``
more with replicas (the exit builds the ``resident`` candidate only where replicas are
resident), where that plan passes the exit's bound; where it does not, the full calls the
exit makes on a run of such steps (one each time what a call could have saved adds up to
its price, ``rent.exit_rent``). Without that charge, replicas whose ``resident`` plan
fails the bound looked free. No threshold enters: a replica is kept when
the cost model says the balance it buys outweighs what it costs (a weight read on its
rank, records sent to it).
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import torch

from moonplan.plan.choice.bound import exit_bound, links_host, totals_host
from moonplan.plan.choice.host import resident_pick
from moonplan.plan.choice.rent import call_price
from moonplan.plan.home import home_list
from moonplan.plan.torch_backend import resident_map
from moonplan.stepcost import StepCost


def replica_counts(totals_E: list[int], num_ranks: int, budget: int) -> list[int]:
    """Holders per expert (home included) after giving out ``budget`` replicas (step 1)."""
    n = [1] * len(totals_E)
    heap = [(-float(t), e) for e, t in enumerate(totals_E) if t > 0]
    heapq.heapify(heap)
    given = 0
    while given < budget and heap:
        _, e = heapq.heappop(heap)
        if n[e] >= num_ranks:
            continue
        n[e] += 1
        given += 1
        heapq.heappush(heap, (-totals_E[e] / n[e], e))
    return n


def pack(
    n_E: list[int], totals_E: list[int], num_slots: int, current: list[list[int]]
) -> list[list[int]]:
    """The slot table ``[R][B]`` holding ``n_E[e] - 1`` replicas of each expert (step 2);
    ``current``: the serving table ``[R][B]`` (``-1`` for an empty slot)."""
    E, R = len(n_E), len(current)
    home = home_list(E, R)
    share = [totals_E[e] / n_E[e] for e in range(E)]
    load = [0.0] * R
    for e in range(E):
        load[home[e]] += share[e]
    slots = [[-1] * num_slots for _ in range(R)]
    need = [n - 1 for n in n_E]
    for r, row in enumerate(current):
        for j, e in enumerate(row[:num_slots]):
            if 0 <= e < E and need[e] > 0 and home[e] != r and e not in slots[r]:
                slots[r][j], need[e], load[r] = e, need[e] - 1, load[r] + share[e]
    for e in sorted((e for e in range(E) for _ in range(need[e])), key=lambda e: (-share[e], e)):
        ok = [r for r in range(R) if -1 in slots[r] and home[e] != r and e not in slots[r]]
        if ok:
            r = min(ok, key=lambda r: (load[r], r))
            slots[r][slots[r].index(-1)], load[r] = e, load[r] + share[e]
    return slots


def mean_step(totals_E: torch.Tensor, steps: int, num_ranks: int) -> np.ndarray:
    """int64 ``[R, E]``: the window's mean step, each expert's records spread evenly over
    the source ranks. Where they do not divide, expert ``e``'s remainder goes one record
    each to the ranks from ``e mod R`` on: every source rank sends about as many records.
    (Giving every remainder to the first ranks made them send a record of every expert
    when experts have fewer records than there are ranks, as at decode sizes, and the
    dispatch that the tables are scored on came out 1.4x the real one.)"""
    mean_E = totals_E.cpu().numpy().astype(np.int64) // max(1, steps)
    R = num_ranks
    turn_RE = (np.arange(R)[:, None] - np.arange(len(mean_E))[None, :]) % R
    return mean_E[None, :] // R + (turn_RE < (mean_E % R)[None, :])


def step_time_over(cost: StepCost, counts_RE: np.ndarray, slot_RB: np.ndarray) -> float:
    """Predicted seconds of the ``resident`` plan of ``counts_RE`` over ``slot_RB`` (no copy,
    no planning charged)."""
    R, E = counts_RE.shape
    home_E = np.asarray(home_list(E, R), dtype=np.int64)
    alloc_ER = resident_pick(cost, counts_RE, slot_RB, home_E)[0]
    none_ER = np.zeros((E, R), dtype=bool)
    return float(cost.step_time(alloc_ER, counts_RE, none_ER, home_E, planned=0).total_s)


def served_s(
    cost: StepCost,
    counts_RE: np.ndarray,
    slot_RB: np.ndarray,
    serve_s: float = 0.0,
    static_s: float | None = None,
) -> float:
    """Predicted seconds of a step of ``counts_RE`` served by ``slot_RB``, its planning
    included, as ``auto`` plans it: the exit's plan (the better of static EP and, with
    replicas resident, the ``resident`` plan) charged the exit's test (``cost.exit_s``, and
    ``serve_s`` with replicas) where it passes the exit's bound
    (:func:`~moonplan.plan.choice.bound.exit_bound`); above it, a full call as often as
    ``rent.exit_rent`` makes one on a run of such steps (:func:`calls_share`).
    ``static_s``: static EP's :func:`step_time_over` of these counts, where the caller
    has it (it does not depend on the slots)."""
    R, E = counts_RE.shape
    static = static_s
    if static is None:
        static = step_time_over(cost, counts_RE, np.full_like(slot_RB, -1))
    held = bool((slot_RB >= 0).any())
    best = min(static, step_time_over(cost, counts_RE, slot_RB)) if held else static
    home_E = np.asarray(home_list(E, R), dtype=np.int64)
    resident_ER = resident_map(torch.from_numpy(slot_RB), E).numpy()
    links = links_host(counts_RE, resident_ER, home_E, cost.domain_size(R))
    totals = totals_host(cost, counts_RE.sum(0))
    bound, _ = exit_bound(cost, R, totals, links, None if held else static + cost.plan_s)
    exit_s = cost.exit_s + (serve_s if held else 0.0)
    over = best + cost.exit_s - bound
    if over <= 0:
        return best + exit_s
    return best + calls_share(over, call_price(cost), exit_s, cost.plan_s)


def calls_share(over: float, checking: float, exit_s: float, plan_s: float) -> float:
    """Seconds of planning per step, on average, of steps whose exit plan is ``over`` seconds
    above the exit's bound (``> 0``): the exit keeps its plan (``exit_s``) until what a full
    call could have saved adds up to the call's price ``checking`` (``rent.exit_rent``),
    then calls (``plan_s``): one call every ``n = ceil(checking / over)`` steps (at least 1)."""
    n = max(1, math.ceil(checking / over))
    return ((n - 1) * exit_s + plan_s) / n


def target_slots(
    totals_E: torch.Tensor,
    steps: int,
    current_RB: torch.Tensor,
    cost: StepCost,
    serve_s: float = 0.0,
) -> torch.Tensor:
    """int64 ``[R, B]``: the table of least predicted step time on the window's mean step,
    planning included (:func:`served_s`; module docstring); ``current_RB`` is the serving
    slot table (its shape gives R, B); ``serve_s``: the planning an exit spends on serving
    replicas (the ``resident`` build)."""
    R, B = current_RB.shape
    totals = [int(t) for t in totals_E.tolist()]
    current = current_RB.cpu().tolist()
    counts_RE = mean_step(totals_E, steps, R)
    static = step_time_over(cost, counts_RE, np.full((R, B), -1, dtype=np.int64))
    best: tuple[float, list[list[int]]] | None = None
    for k in range(B + 1):
        table = pack(replica_counts(totals, R, k * R), totals, B, current)
        slot_RB = np.array(table, dtype=np.int64).reshape(R, B)
        t = served_s(cost, counts_RE, slot_RB, serve_s, static)
        if best is None or t < best[0]:
            best = (t, table)
    assert best is not None
    return torch.tensor(best[1], dtype=torch.int64).reshape(R, B)
