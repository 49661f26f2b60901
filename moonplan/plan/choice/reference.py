"""The readable definition of ``policy="auto"``: every candidate built, scored, the least kept.

Legend:
    R ranks    E experts    B slots    K levels    C = K + 4 candidates
    T[e]       records of expert e     L[r]  static load of rank r    N  records in all
    resident   pairs ``(e, r)`` with ``e`` in ``previous``'s slots of rank ``r``

Plain Python and the planner's reference construction (``moonplan.plan.reference``); the
torch (``tensor.py``), host (``host.py``) and CUDA forms give the same plan and scores,
bit for bit. The rule, for counts, ``previous`` and a cost model:

1. **Early exit.** Score static EP and, with replicas resident in ``previous``'s slots,
   the ``placed`` candidate. Build the ``resident`` candidate too only where the better of
   those two is above the least time of any plan that copies nothing charged the test and
   its least build (``rent.exit_build_s``, :func:`~moonplan.plan.choice.bound.nocopy_s`):
   elsewhere it cannot beat them by its build. Every exit plan is charged the exit's test
   (``cost.exit_s``); the build, where made, is spent by then whichever plan runs, so it
   does not enter the comparison (whoever runs the step charges its rounds:
   ``Choice.rounds``, in a full call too, whose own ``resident`` build runs them where the
   exit made none).
   If the best of them (ties: the earlier entry) is at most
   :func:`~moonplan.plan.choice.bound.exit_bound` (a time no candidate that copies can beat;
   without residents, static EP charged a full call too), or above it by less, summed
   since the last full call, than a full call's planning beyond the test, and no buy can
   be due (:func:`~moonplan.plan.choice.rent.exit_rent`), return it: nothing else is
   built or scored.
2. **Candidates.** Otherwise build every entry of the table
   (:mod:`~moonplan.plan.choice.table`): static EP; each ``level-k``, ``exact`` and
   ``greedy`` by one run of the group-flow construction (``level-k`` towards
   ``water_fill(L, cap_k)``, ``exact`` towards the exact targets, both replaying
   ``previous``; ``greedy`` without ``previous``); ``resident``, a diffusion over the
   replicas resident in ``previous``'s slots, rounded to whole records or to whole GEMM
   tiles, whichever the cost model predicts faster.
3. **Scores.** Each candidate's predicted step time (``cost.step_time``), charged one
   planner call (``cost.plan_s``), with the weights it fetches: its replicas that are not
   resident in ``previous``'s slots; and its *free* score, the same with nothing fetched.
4. **Choice.** The rent-or-buy rule (:mod:`~moonplan.plan.choice.rent`): the least score
   (ties to the earlier entry of the table), unless the rent accrued since the last buy
   pays for the copies of the least free score. Static EP is a candidate, so a step that
   buys nothing is never predicted slower than static EP, and a step that buys is above
   its least score by at most the rent accrued.
5. **Layout.** The winner's slots (residents kept) and rows (``from_alloc`` layout); its
   construction's flows are recorded for the next step's replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moonplan.plan.choice.bound import (
    exit_bound,
    experts_lb_s,
    kept_section_s,
    links_reference,
    nocopy_s,
)
from moonplan.plan.choice.rent import call_price, exit_build_s, exit_rent, settle
from moonplan.plan.choice.resident import resident_reference
from moonplan.plan.choice.table import LEVELS, RESIDENT, Candidate, placed_index, table
from moonplan.plan.choice.targets import level_caps, water_fill
from moonplan.plan.from_alloc import layout_reference
from moonplan.plan.home import home_list
from moonplan.plan.plan_fields import PlanFields, padded_flows
from moonplan.plan.reference import Flow, reference_plan
from moonplan.stepcost.step_cost import StepCost, StepTime

Alloc = list[list[int]]  # [E][R]


@dataclass(frozen=True)
class Chosen:
    """The reference choice: the winner's layout tensors and how it was chosen."""

    fields: PlanFields
    index: int
    scores: list[float]  # [C], inf where not scored
    exited: bool
    credit: float  # the rent-or-buy credit carried to the next step
    pending: float  # what a full call could have saved since the last one (rent.exit_rent)
    rounds: int = 0  # rounds of this call's resident build (Choice.rounds)


@dataclass(frozen=True)
class Step:
    """One step's inputs as plain Python values."""

    counts: list[list[int]]  # [R][E]
    slots: int
    align: int
    prev_slots: list[list[int]] | None  # [R][B]
    prev_flows: list[Flow]
    credit: float = 0.0  # ``previous``'s rent-or-buy credit (0 without one)
    pending: float = 0.0  # ``previous``'s ``Choice.pending`` (0 without one)

    @property
    def resident(self) -> set[tuple[int, int]]:
        """``(e, r)`` pairs resident in ``previous``'s slots."""
        rows = self.prev_slots or []
        return {(e, r) for r, row in enumerate(rows) for e in row if e >= 0}


def choose_reference(step: Step, cost: StepCost, levels: int = LEVELS) -> Chosen:
    """``policy="auto"`` on ``step`` (module docstring); the fields are CPU int64 tensors."""
    counts = step.counts
    R, E = len(counts), len(counts[0])
    home = home_list(E, R)
    static = _static_alloc(counts, home)
    links = links_reference(counts, step.resident, home, cost.domain_size(R))
    totals = _totals(cost, counts)
    scores = [math.inf] * (levels + 4)

    def timed(alloc: Alloc, i: int) -> tuple[Alloc, StepTime, int]:
        return alloc, _step_time(cost, step, alloc, cost.exit_s), i

    exits = [timed(static, 0)]
    res, rounds = None, 0
    if step.resident:  # the exit's other plans: the slots, whole experts or balanced
        exits.append(timed(_placed(step), placed_index(levels)))
        cheap = min(t.total_s for _, t, _ in exits)
        kept = kept_section_s(cost, counts, step.resident, home)
        if cheap > nocopy_s(cost, R, totals, links, exit_build_s(cost), kept):
            res, rounds = _resident(step, cost)
            exits.append(timed(res, RESIDENT))
    for _, t, i in exits:
        scores[i] = t.total_s
    exit_alloc, at_exit, index = min(exits, key=lambda x: (x[1].total_s, x[2]))
    t_exit = at_exit.total_s
    static_full = None if step.resident else _time(cost, step, static, cost.plan_s)
    bounds = exit_bound(cost, R, totals, links, static_full)
    gap = at_exit.experts_s - experts_lb_s(cost, R, *totals)
    checking = call_price(cost)
    carried = (step.credit, step.pending)
    exited, credit, pending = exit_rent(t_exit, gap, bounds, carried, checking)
    if exited:
        fields = _layout(step, exit_alloc, [])
        return Chosen(fields, index, scores, True, credit, pending, rounds)
    if res is None:  # the exit built no resident: the full call's own build runs the rounds
        res, rounds = _resident(step, cost)
    built = [(res, []) if c.kind == "resident" else build(c, step, levels, cost)
             for c in table(levels)]  # fmt: skip
    scores = [_time(cost, step, alloc, cost.plan_s) for alloc, _ in built]
    free = [_time(cost, step, alloc, cost.plan_s, free=True) for alloc, _ in built]
    best, credit = settle(scores, free, credit)
    alloc, flows = built[best]
    return Chosen(_layout(step, alloc, flows), best, scores, False, credit, pending, rounds)


def _static_alloc(counts: list[list[int]], home: list[int]) -> Alloc:
    R, E = len(counts), len(counts[0])
    alloc = [[0] * R for _ in range(E)]
    for e in range(E):
        alloc[e][home[e]] = sum(row[e] for row in counts)
    return alloc


def build(
    c: Candidate, step: Step, levels: int, cost: StepCost | None = None
) -> tuple[Alloc, list[Flow]]:
    """A candidate's allocation and the flows its construction recorded (none without one;
    ``cost``: what picks the ``resident`` candidate's rounding, :func:`_resident`)."""
    R, E = len(step.counts), len(step.counts[0])
    static = _static_alloc(step.counts, home_list(E, R))
    if c.kind == "static":
        return static, []
    if c.kind == "resident":
        return _resident(step, cost)[0], []
    if c.kind == "placed":
        return _placed(step), []
    prev = (step.prev_slots, step.prev_flows)
    if c.kind == "greedy":
        prev = (None, [])
    target = None
    if c.kind == "level":
        load = [sum(row) for row in zip(*static, strict=True)]
        target = water_fill(load, level_caps(load, levels)[c.level - 1])
    res = reference_plan(step.counts, step.slots, 1, prev[0], prev[1], target)
    return res.alloc, res.flows


def _placed(step: Step) -> Alloc:
    """The ``placed`` candidate: each expert's records all on the lowest rank holding it in
    ``previous``'s slots, else on its home."""
    R, E = len(step.counts), len(step.counts[0])
    home = home_list(E, R)
    server = list(home)
    for e, r in sorted(step.resident, reverse=True):  # the lowest holder of e written last
        if r != home[e]:
            server[e] = r
    return _static_alloc(step.counts, server)  # static EP over the servers


def _resident(step: Step, cost: StepCost | None) -> tuple[Alloc, int]:
    """The ``resident`` candidate: the diffusion rounded to whole records, or to whole
    tiles of ``cost.tile_rows`` where the step is predicted faster so (charged the exit's
    test; ties: records), and the rounds both ran. Without a cost, or with a tile of one
    row, records."""
    R, E = len(step.counts), len(step.counts[0])
    home = home_list(E, R)
    by_records, n = resident_reference(step.counts, step.prev_slots, home, 1, cost)
    if cost is None or cost.tile_rows == 1 or not step.resident:
        return by_records, n
    by_tiles, m = resident_reference(step.counts, step.prev_slots, home, cost.tile_rows, cost)
    faster = _time(cost, step, by_tiles, cost.exit_s) < _time(cost, step, by_records, cost.exit_s)
    return (by_tiles if faster else by_records), n + m


def _time(cost: StepCost, step: Step, alloc: Alloc, plan_s: float, free: bool = False) -> float:
    """Predicted step seconds of ``alloc``, charged ``plan_s`` of planning (``free``: its
    copies already resident, none fetched)."""
    return _step_time(cost, step, alloc, plan_s, free).total_s


def _step_time(
    cost: StepCost, step: Step, alloc: Alloc, plan_s: float, free: bool = False
) -> StepTime:
    """:func:`_time`'s phases."""
    R, E = len(step.counts), len(step.counts[0])
    home = home_list(E, R)
    resident = step.resident
    fetch = [[alloc[e][r] > 0 and r != home[e] and (e, r) not in resident and not free
              for r in range(R)] for e in range(E)]  # fmt: skip
    return cost.scaled(plan_s=plan_s).step_time(
        torch.tensor(alloc, dtype=torch.int64).reshape(E, R),
        torch.tensor(step.counts, dtype=torch.int64),
        torch.tensor(fetch, dtype=torch.bool).reshape(E, R),
        torch.tensor(home, dtype=torch.int64),
        planned=1,
    )


def _totals(cost: StepCost, counts: list[list[int]]) -> tuple[int, int, int]:
    """``(sum_e tile(T[e]), experts with records, N)`` for the bound."""
    T = [sum(col) for col in zip(*counts, strict=True)]
    t = cost.tile_rows
    return sum(-(-x // t) * t for x in T), sum(1 for x in T if x > 0), sum(T)


def _roofline(cost: StepCost, padded: int, experts: int, rows: int) -> float:
    """``StepCost``'s roofline of one rank's integer sums."""
    mem = experts * cost.weight_read_s + rows * cost.row_mem_s
    return max(padded * cost.row_flop_s, mem)


def _layout(step: Step, alloc: Alloc, flows: list[Flow]) -> PlanFields:
    """The layout tensors of ``alloc`` (residents keep their slot) with ``flows`` recorded."""
    R, E = len(step.counts), len(step.counts[0])
    counts = torch.tensor(step.counts, dtype=torch.int64)
    prev = None if step.prev_slots is None else torch.tensor(step.prev_slots, dtype=torch.int64)
    a = torch.tensor(alloc, dtype=torch.int64).reshape(E, R)
    fields = layout_reference(counts, a, step.slots, step.align, prev)
    return fields._replace(flow=padded_flows(flows, R))
