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

3. **Whole moves** (:func:`whole_moves`), one more table: experts moved, as EPLB moves
   them, for the ``placed`` plan to serve with a lookup. The rank whose experts phase is
   predicted longest gives one home expert at a time to the free slot of the rank
   predicted shortest (the longest-first rule of makespan scheduling), while that shortens
   the longer of the two.

The table chosen is the one with the least predicted time over the window's own steps
(:func:`window_s`, computed for every step at once by
:func:`~moonplan.plan.residency.window_torch.window_torch`, equal float for float; ties:
the earlier, fewer replicas first, whole moves last), each step
spread over the sources as the mean step is. The steps, not their mean: the mean step
hides the fluctuation that replicas absorb and whole moves do not. Each step is planned as
``auto`` would plan it (:func:`served_s`): the best of static EP, ``placed`` and, where it
could beat those by its build, the ``resident`` plan (``moonplan.plan.choice.resident``,
the plan each step makes inside the slots), charged the planning it costs: the early
exit's test, and the rounds of its build (``StepCost.round_s`` each) where the exit builds
``resident``, where that
plan passes the exit's bound; where it does not, the full calls the exit makes on a run of
such steps (one each time what a call could have saved adds up to its price,
``rent.exit_rent``). Without that charge, replicas whose ``resident`` plan fails the bound
looked free. No threshold enters: a replica is kept when the cost model says the balance
it buys outweighs what it costs (a weight read on its rank, records sent to it).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np
import torch

from moonplan.plan.choice.bound import (
    exit_bound,
    kept_section_host,
    links_host,
    nocopy_s,
    totals_host,
)
from moonplan.plan.choice.host import placed_host, resident_pick
from moonplan.plan.choice.rent import (
    call_price,
    call_rounds_s,
    exit_build_s,
    exit_rounds_s,
    roundings,
)
from moonplan.plan.home import home_list
from moonplan.plan.residency.exact_way import EXACT, exact_steps_s
from moonplan.plan.residency.serving import LOOKUPS, WEIGHTED
from moonplan.plan.residency.weighted_way import crossed_shares
from moonplan.plan.residency.window_torch import lookups_torch, static_torch, windows_torch
from moonplan.plan.residency.work import Builds
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


def step_time_over(
    cost: StepCost, counts_RE: np.ndarray, slot_RB: np.ndarray, builds: Builds | None = None
) -> float:
    """Predicted seconds of the ``resident`` plan of ``counts_RE`` over ``slot_RB`` (no copy,
    no planning charged); one build more in ``builds``."""
    return resident_over(cost, counts_RE, slot_RB, builds)[0]


def resident_over(
    cost: StepCost, counts_RE: np.ndarray, slot_RB: np.ndarray, builds: Builds | None = None
) -> tuple[float, int]:
    """:func:`step_time_over` and the rounds its build ran (``Choice.rounds``)."""
    if builds is not None:
        builds.made += 1
    R, E = counts_RE.shape
    home_E = np.asarray(home_list(E, R), dtype=np.int64)
    alloc_ER, _, rounds = resident_pick(cost, counts_RE, slot_RB, home_E)
    none_ER = np.zeros((E, R), dtype=bool)
    step = cost.step_time(alloc_ER, counts_RE, none_ER, home_E, planned=0)
    return float(step.total_s), rounds


def served_s(
    cost: StepCost,
    counts_RE: np.ndarray,
    slot_RB: np.ndarray,
    static_s: float | None = None,
    builds: Builds | None = None,
) -> float:
    """Predicted seconds of a step of ``counts_RE`` served by ``slot_RB``, its planning
    included, as ``auto`` plans it (``moonplan.plan.choice.reference``): the exit's plan,
    the best of static EP and, with replicas resident, ``placed`` and (where it could beat
    those by its build) the ``resident`` plan, charged the exit's test (``cost.exit_s``, and
    the rounds of the ``resident`` build where it made one, ``rent.exit_rounds_s``) where it
    passes the exit's bound
    (:func:`~moonplan.plan.choice.bound.exit_bound`); above it, a full call as often as
    ``rent.exit_rent`` makes one on a run of such steps (:func:`calls_share`).
    ``static_s``: static EP's :func:`step_time_over` of these counts, where the caller
    has it (it does not depend on the slots). ``builds``: counts the step scored, and
    the builds made."""
    R, E = counts_RE.shape
    static = static_s
    if static is None:
        static = step_time_over(cost, counts_RE, np.full_like(slot_RB, -1), builds)
    held = bool((slot_RB >= 0).any())
    if builds is not None:
        builds.scored += 1
    home_E = np.asarray(home_list(E, R), dtype=np.int64)
    resident_ER = resident_map(torch.from_numpy(slot_RB), E).numpy()
    links = links_host(counts_RE, resident_ER, home_E, cost.domain_size(R))
    totals = totals_host(cost, counts_RE.sum(0))
    best, rounds, fewest = static, 0, roundings(cost) if held else 1
    if held:
        best = min(best, placed_over(cost, counts_RE, resident_ER))
        kept = kept_section_host(cost, counts_RE, resident_ER, home_E)
        if best + cost.exit_s > nocopy_s(cost, R, totals, links, exit_build_s(cost), kept):
            built, rounds = resident_over(cost, counts_RE, slot_RB, builds)
            best = min(best, built)
    bound, _ = exit_bound(cost, R, totals, links, None if held else static + cost.plan_s)
    over = best + cost.exit_s - bound  # the exit weighs its plan charged its test alone
    exit_s = exit_rounds_s(cost, rounds)
    if over <= 0:
        return best + exit_s
    call_s = call_rounds_s(cost, rounds or fewest)  # the call's own build: its fewest rounds
    return best + calls_share(over, call_price(cost), exit_s, call_s)


def placed_over(cost: StepCost, counts_RE: np.ndarray, resident_ER: np.ndarray) -> float:
    """Predicted seconds of the ``placed`` plan of ``counts_RE`` over the resident pairs
    (bool ``resident_ER``; no copy, no planning charged)."""
    R, E = counts_RE.shape
    home_E = np.asarray(home_list(E, R), dtype=np.int64)
    alloc_ER = placed_host(counts_RE.sum(0), resident_ER, home_E)
    none_ER = np.zeros((E, R), dtype=bool)
    return float(cost.step_time(alloc_ER, counts_RE, none_ER, home_E, planned=0).total_s)


def calls_share(over: float, checking: float, exit_s: float, plan_s: float) -> float:
    """Seconds of planning per step, on average, of steps whose exit plan is ``over`` seconds
    above the exit's bound (``> 0``): the exit keeps its plan (``exit_s``) until what a full
    call could have saved adds up to the call's price ``checking`` (``rent.exit_rent``),
    then calls (``plan_s``, the call's charge with its rounds): one call every
    ``n = ceil(checking / over)`` steps (at least 1)."""
    n = max(1, math.ceil(checking / over))
    return ((n - 1) * exit_s + plan_s) / n


def whole_moves(
    cost: StepCost, counts_RE: np.ndarray, num_slots: int, current: list[list[int]]
) -> list[list[int]]:
    """The slot table ``[R][B]`` of whole experts moved (step 3 of the module docstring):
    from the homes, one expert at a time leaves the rank whose experts phase is predicted
    longest (``StepCost``'s roofline of the mean step's rows) for a free slot of the rank
    predicted shortest: the home expert that makes the longer of the two least, while that
    is below the longest. ``current``: the serving table (a moved expert it holds on the
    same rank keeps its slot)."""
    R, E = counts_RE.shape
    T = [int(t) for t in counts_RE.sum(0)]
    home = home_list(E, R)
    sums = [[0, 0, 0] for _ in range(R)]  # padded rows, experts with rows, rows
    for e in range(E):
        _add(cost, sums[home[e]], T[e], 1)
    free, moved = [num_slots] * R, {}
    while True:
        t_R = [_section_s(cost, x) for x in sums]
        b = max(range(R), key=lambda r: (t_R[r], -r))
        open_R = [r for r in range(R) if free[r] > 0 and r != b]
        if not open_R:
            break
        g = min(open_R, key=lambda r: (t_R[r], r))
        best: tuple[float, int] | None = None
        for e in range(E):
            if home[e] == b and e not in moved and T[e] > 0:
                m = max(_moved_s(cost, sums[b], T[e], -1), _moved_s(cost, sums[g], T[e], 1))
                if m < t_R[b] and (best is None or m < best[0]):
                    best = (m, e)
        if best is None:
            break
        e = best[1]
        _add(cost, sums[b], T[e], -1)
        _add(cost, sums[g], T[e], 1)
        moved[e], free[g] = g, free[g] - 1
    return _seat(moved, num_slots, current)


def _add(cost: StepCost, sums: list[int], rows: int, sign: int) -> None:
    """Add (``sign = 1``) or remove (``-1``) an expert of ``rows`` rows to a rank's sums."""
    if rows > 0:
        t = cost.tile_rows
        sums[0] += sign * (-(-rows // t) * t)
        sums[1] += sign
        sums[2] += sign * rows


def _moved_s(cost: StepCost, sums: list[int], rows: int, sign: int) -> float:
    """A rank's experts phase with an expert of ``rows`` rows added or removed."""
    trial = list(sums)
    _add(cost, trial, rows, sign)
    return _section_s(cost, trial)


def _section_s(cost: StepCost, sums: list[int]) -> float:
    """``StepCost``'s roofline of a rank's ``[padded rows, experts, rows]``."""
    padded, experts, rows = sums
    return max(cost.row_flop_s * padded, cost.weight_read_s * experts + cost.row_mem_s * rows)


def _seat(moved: dict[int, int], num_slots: int, current: list[list[int]]) -> list[list[int]]:
    """The table ``[R][B]`` holding each moved expert ``e`` on rank ``moved[e]``; one the
    serving table already holds there keeps its slot."""
    slots = [[-1] * num_slots for _ in current]
    later = []
    for e, r in sorted(moved.items()):
        row = current[r][:num_slots]
        if e in row and slots[r][row.index(e)] == -1:
            slots[r][row.index(e)] = e
        else:
            later.append((e, r))
    for e, r in later:
        slots[r][slots[r].index(-1)] = e
    return slots


@dataclass(frozen=True)
class Target:
    """What the window's steps prefer (:func:`target_of`).

    Attributes:
        slot_RB: int64 ``[R, B]``, the table of least predicted time.
        serve: how it serves: ``"call"``, a planner call every step (``auto``), each step
            charged the exit's test or the full calls it makes; or a lookup plan with no
            call (one of ``serving.LOOKUPS`` or ``serving.WEIGHTED``; static EP over an
            empty table), where no
            table served by calls is predicted faster over the window; or ``"exact"``
            (``exact_way``), the serving slots' exact plan every step, where it is faster
            than every table (``slot_RB`` is then the serving table: no refill).
        kept: the way of least predicted time over the window for the serving table
            (``current_RB``, the exact way included), which serves until a refill brings
            another.
        seconds: the predicted seconds of the window's steps served so (``slot_RB``,
            ``serve``).
    """

    slot_RB: torch.Tensor
    serve: str
    kept: str = "call"
    seconds: float = math.nan


def target_of(
    totals_E: torch.Tensor,
    steps: int,
    current_RB: torch.Tensor,
    cost: StepCost,
    loads_SE: torch.Tensor | None = None,
    builds: Builds | None = None,
) -> Target:
    """The table and the way of serving it of least predicted time over the window's
    steps, among the ``B + 1`` replica tables and the whole moves (:func:`whole_moves`),
    each served by its lookup plans without a call (``window_torch.lookups_torch``) or by
    planner calls (planning included: :func:`served_s`; module docstring). Ties go to the
    earlier table, and to the lookups (no call), in :data:`WAYS` order. Where the
    exact way from the serving slots (``exact_way``: exact balance every step, no table
    kept) is faster than every table, it is the target's way, over ``current_RB``.
    ``loads_SE``: int64 ``[S, E]``, each step's loads, each spread over the sources as
    the mean step is (``None``: the mean step of ``totals_E`` over ``steps`` alone).
    ``current_RB`` is the serving slot table (its shape gives R, B); ``builds`` counts the
    work. The tables are made on the host; their scores run on ``loads_SE``'s device (the
    window's: on CUDA, the stream current where this runs), and the table returned is on
    the host."""
    slot_TRB, rows_SRE = candidate_tables(totals_E, steps, current_RB, cost, loads_SE)
    T = len(slot_TRB)
    same = [t for t in range(T) if torch.equal(slot_TRB[t], current_RB.cpu())]
    scored_TRB = slot_TRB if same else torch.cat([slot_TRB, current_RB.cpu()[None]])
    ways = table_ways(cost, rows_SRE, scored_TRB, loads_SE, builds)
    t = min(range(T), key=lambda t: ways[t][0])  # the first of the least
    kept = ways[same[0] if same else T]
    exact = sum(exact_steps_s(cost, rows_SRE, current_RB.cpu(), builds))
    if exact < ways[t][0]:  # exact balance every step beats every table: keep the slots
        return Target(current_RB.cpu().clone(), EXACT, EXACT, exact)
    way = EXACT if exact < kept[0] else kept[1]
    return Target(slot_TRB[t].clone(), ways[t][1], way, ways[t][0])


WAYS = (*LOOKUPS, WEIGHTED, "call")
"""The ways a table serves, in tie-break order: its lookups (no call; the weighted one
last of them, as it needs its weights), then planner calls."""


def table_ways(
    cost: StepCost,
    rows_SRE: torch.Tensor,
    slot_TRB: torch.Tensor,
    loads_SE: torch.Tensor | None = None,
    builds: Builds | None = None,
) -> list[tuple[float, str]]:
    """Per table of ``slot_TRB`` (int64 ``[T, R, B]``, on the host): its least predicted
    seconds over the steps ``rows_SRE`` (int64 ``[S, R, E]``, :func:`candidate_tables`)
    and the way of :data:`WAYS` that serves it so (the first of the least, each way's
    steps summed in step order). The weighted lookup is scored with weights fit on the
    other steps (:func:`crossed_shares`). The scores run on ``loads_SE``'s device
    (``None``: the host); ``builds`` counts the work."""
    out = []
    for steps_WS in table_way_steps(cost, rows_SRE, slot_TRB, loads_SE, builds):
        sums = [sum(steps_S) for steps_S in steps_WS]
        w = min(range(len(WAYS)), key=lambda w: sums[w])
        out.append((sums[w], WAYS[w]))
    return out


def table_way_steps(
    cost: StepCost,
    rows_SRE: torch.Tensor,
    slot_TRB: torch.Tensor,
    loads_SE: torch.Tensor | None = None,
    builds: Builds | None = None,
    static_S: torch.Tensor | None = None,
) -> list[list[list[float]]]:
    """``[T][W][S]``: per table of ``slot_TRB``, per way of :data:`WAYS`, the predicted
    seconds of each step of ``rows_SRE`` (oldest first) served so; what
    :func:`table_ways` sums (arguments as there; ``static_S``: static EP's seconds of
    each step where the caller scored them, on :func:`scores_device`)."""
    dev = scores_device(loads_SE)
    rows_SRE, slot_TRB = rows_SRE.to(dev), slot_TRB.to(dev)
    if static_S is None:
        static_S = static_torch(cost, rows_SRE)
    looked_LTS = _lookups(cost, rows_SRE, slot_TRB, static_S, builds).tolist()
    called = windows_torch(cost, rows_SRE, static_S, slot_TRB, builds).tolist()
    if builds is not None:  # static EP's step over the window
        builds.scored += len(rows_SRE)
    return [[look[t] for look in looked_LTS] + [call_S] for t, call_S in enumerate(called)]


def scores_device(loads_SE: torch.Tensor | None) -> torch.device:
    """Where a window's scores run: ``loads_SE``'s device (``None``: the host)."""
    return loads_SE.device if loads_SE is not None else torch.device("cpu")


def _lookups(
    cost: StepCost,
    rows_SRE: torch.Tensor,
    slot_TRB: torch.Tensor,
    static_S: torch.Tensor,
    builds: Builds | None,
) -> torch.Tensor:
    """float64 ``[L, T, S]``: each table's lookups over the steps (``lookups_torch``, the
    weighted one last with :func:`crossed_shares`). Over a table without replicas every
    lookup is static EP (``static_S``), so only the tables with replicas are scored (and
    counted in ``builds``). With one step there is no other step to fit the weighted
    lookup's shares on: it is not a way then (infinite)."""
    L, T, S = len(WAYS) - 1, len(slot_TRB), len(rows_SRE)
    out_LTS = static_S[None, None].expand(L, T, S).clone()
    held_T = (slot_TRB >= 0).flatten(1).any(1)
    if bool(held_T.any()):
        held_TRB = slot_TRB[held_T]
        weight_STER = crossed_shares(cost, rows_SRE, held_TRB) if S >= 2 else None
        got_LTS = lookups_torch(cost, rows_SRE, held_TRB, builds, weight_STER)
        out_LTS[: len(got_LTS), held_T] = got_LTS
        out_LTS[len(got_LTS) :, held_T] = math.inf
    return out_LTS


def candidate_tables(
    totals_E: torch.Tensor,
    steps: int,
    current_RB: torch.Tensor,
    cost: StepCost,
    loads_SE: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables :func:`target_of` scores, int64 ``[T, R, B]`` in its order, each once
    (an equal later table scores alike: the earlier stands), and the steps it scores them
    on, int64 ``[S, R, E]`` (arguments as there)."""
    R, B = current_RB.shape
    totals = [int(t) for t in totals_E.tolist()]
    current = current_RB.cpu().tolist()
    mean_RE = mean_step(totals_E, steps, R)
    tables = [pack(replica_counts(totals, R, k * R), totals, B, current) for k in range(B + 1)]
    tables.append(whole_moves(cost, mean_RE, B, current))
    unique: dict[tuple[int, ...], list[list[int]]] = {}
    for table in tables:
        unique.setdefault(tuple(e for row in table for e in row), table)
    slot_TRB = torch.from_numpy(np.stack([_table(t, R, B) for t in unique.values()]))
    return slot_TRB, window_rows(totals_E, steps, R, loads_SE)


def window_rows(
    totals_E: torch.Tensor, steps: int, num_ranks: int, loads_SE: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 ``[S, R, E]`` on the host: the steps a table is scored on, each step's loads
    (``loads_SE``) spread over the sources as the mean step is (:func:`mean_step`); without
    ``loads_SE``, the one mean step of ``totals_E`` over ``steps``."""
    if loads_SE is None:
        return torch.from_numpy(mean_step(totals_E, steps, num_ranks)[None])
    return torch.from_numpy(np.stack([mean_step(l_E, 1, num_ranks) for l_E in loads_SE.cpu()]))


def _table(table: list[list[int]], R: int, B: int) -> np.ndarray:
    return np.array(table, dtype=np.int64).reshape(R, B)


def window_s(
    cost: StepCost,
    rows: list[np.ndarray],
    statics: list[float],
    slot_RB: np.ndarray,
    builds: Builds | None = None,
) -> float:
    """Predicted seconds of the steps ``rows`` (each int64 ``[R, E]``; ``statics``: static
    EP's :func:`step_time_over` of each) served by ``slot_RB``, planning included
    (:func:`served_s`). Scored step by step, not on their
    mean: the mean step hides each expert's step-to-step fluctuation, which replicas
    absorb and whole moves do not (chosen on the mean step alone, whole moves were up to
    12% slower than the replicas they replaced, and the replica count missed in both
    directions: ``docs/benchmarks.md``)."""
    pairs = zip(rows, statics, strict=True)
    return sum(served_s(cost, c_RE, slot_RB, s, builds) for c_RE, s in pairs)
