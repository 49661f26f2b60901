"""``policy="auto"`` for CPU tensors: the reference's rule on host integers, then torch.

Legend:
    R ranks    E experts    B slots    K levels    C = K + 4 candidates
    counts_RE  int64 [R, E] validated counts (CPU)
    alloc_CER  int64 [C, E, R] every candidate's allocation
    fetch_CER  bool  [C, E, R] replicas not resident in ``previous``'s slots

The same choice as :mod:`moonplan.plan.choice.reference`, bit for bit, with the fast
forms: the group-flow constructions as host heap scans (``group_flows.host_moves``), the
scores of all candidates in one :func:`~moonplan.stepcost.batch.batch_step_time`, the
layout of the winner only (``from_alloc.layout_torch``). Where reading is free (the CPU)
the early exit skips every construction. :mod:`moonplan.plan.choice.tensor` is the form
that reads nothing on the host, for other devices.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from moonplan.plan.choice.bound import (
    exit_bound,
    experts_lb_s,
    kept_section_host,
    links_host,
    nocopy_s,
    totals_host,
)
from moonplan.plan.choice.rent import call_price, exit_build_s, exit_rent, settle
from moonplan.plan.choice.resident import resident_host
from moonplan.plan.choice.table import LEVELS, RESIDENT, Candidate, placed_index, table
from moonplan.plan.choice.targets import level_caps, water_fill
from moonplan.plan.from_alloc import layout_resident, layout_torch
from moonplan.plan.group_flows import host_moves, warm_maps
from moonplan.plan.home import home_edges, targets_list
from moonplan.plan.plan_fields import PlanFields, padded_flows
from moonplan.plan.reference import Flow, previous_flows
from moonplan.stepcost.batch import batch_step_time
from moonplan.stepcost.step_cost import StepCost, StepTime


@dataclass(frozen=True)
class HostStep:
    """One step's inputs on the host: numpy views and Python integers."""

    counts: np.ndarray  # int64 [R, E]
    num_slots: int
    align: int
    prev_RB: torch.Tensor | None
    prev_F3: torch.Tensor | None
    edges: list[int]  # [R + 1] home groups
    home: np.ndarray  # int64 [E]
    total: np.ndarray  # int64 [E] records per expert
    load: list[int]  # [R] static loads

    @classmethod
    def of(
        cls,
        counts_RE: torch.Tensor,
        num_slots: int,
        align: int,
        prev: tuple[torch.Tensor | None, torch.Tensor | None],
    ) -> HostStep:
        c = counts_RE.numpy()
        R, E = c.shape
        edges = home_edges(E, R)
        home = np.repeat(np.arange(R, dtype=np.int64), np.diff(edges))
        total = c.sum(0)
        cum = np.concatenate([[0], np.cumsum(total)])
        load = (cum[edges[1:]] - cum[edges[:-1]]).tolist()
        return cls(c, num_slots, align, prev[0], prev[1], edges, home, total, load)

    @property
    def resident(self) -> np.ndarray:
        """bool ``[E, R]``: ``e`` sits in one of rank ``r``'s previous slots."""
        R, E = self.counts.shape
        out = np.zeros((E + 1, R), dtype=bool)
        if self.prev_RB is not None:
            slots = self.prev_RB.numpy()
            out[np.where(slots >= 0, slots, E), np.arange(R)[:, None]] = True
        return out[:E]

    def static(self) -> np.ndarray:
        """int64 ``[E, R]``: static EP's allocation."""
        R, E = self.counts.shape
        a = np.zeros((E, R), dtype=np.int64)
        a[np.arange(E), self.home] = self.total
        return a


def choose_host(
    counts_RE: torch.Tensor,
    num_slots: int,
    align: int,
    prev: tuple[torch.Tensor | None, torch.Tensor | None],
    cost: StepCost,
    levels: int = LEVELS,
    carried: tuple[float, float] = (0.0, 0.0),
) -> tuple[PlanFields, tuple[int, torch.Tensor, bool, float, float, int]]:
    """The winner's layout tensors and ``(index, scores [C], exited, credit, pending,
    rounds)`` (``rounds``: of this call's ``resident`` build, ``Choice.rounds``); CPU
    tensors (``carried``: ``previous``'s rent-or-buy credit and pending call,
    ``rent.exit_rent``)."""
    hs = HostStep.of(counts_RE, num_slots, align, prev)
    R = len(hs.load)
    resident = hs.resident
    static = hs.static()
    scores = torch.full((levels + 4,), float("inf"), dtype=torch.float64)
    timed = functools.partial(_no_fetch_time, cost, hs.counts, hs.home)
    totals = totals_host(cost, hs.total)
    links = links_host(hs.counts, resident, hs.home, cost.domain_size(R))
    exits = [(static, timed(static, cost.exit_s), 0)]
    res, rounds = None, 0
    if resident.any():  # the exit's other plans: the slots, whole experts or balanced
        placed = placed_host(hs.total, resident, hs.home)
        exits.append((placed, timed(placed, cost.exit_s), placed_index(levels)))
        cheap = min(t.total_s for _, t, _ in exits)
        kept = kept_section_host(cost, hs.counts, resident, hs.home)
        if cheap > nocopy_s(cost, R, totals, links, exit_build_s(cost), kept):
            res, at_res, rounds = resident_pick(cost, hs.counts, hs.prev_RB, hs.home)
            if at_res is None:  # records alone were built: time them here
                at_res = timed(res, cost.exit_s)
            exits.append((res, at_res, RESIDENT))
    for _, t, i in exits:
        scores[i] = t.total_s
    exit_alloc, at_exit, index = min(exits, key=lambda x: (x[1].total_s, x[2]))
    t_exit = at_exit.total_s
    full = None if resident.any() else timed(static, cost.plan_s).total_s
    bounds = exit_bound(cost, R, totals, links, full)
    gap = at_exit.experts_s - experts_lb_s(cost, R, *totals)
    checking = call_price(cost)
    exited, credit, pending = exit_rent(t_exit, gap, bounds, carried, checking)
    if exited:
        fields = layout_resident(torch.from_numpy(exit_alloc), num_slots, align, hs.prev_RB)
        return fields, (index, scores, True, credit, pending, rounds)
    if res is None:  # the full call's own resident build: its rounds are this call's
        res, _, rounds = resident_pick(cost, hs.counts, hs.prev_RB, hs.home)
    built = build_all(hs, levels, res, cost)
    alloc_CER = np.stack([a for a, _ in built])
    scores = _scores(cost, hs, alloc_CER, resident, cost.plan_s)
    free = _scores(cost, hs, alloc_CER, np.ones_like(resident), cost.plan_s)
    best, credit = settle(scores.tolist(), free.tolist(), credit)
    made = (best, scores, False, credit, pending, rounds)
    return layout(hs, alloc_CER[best], built[best][1]), made


def _no_fetch_time(
    cost: StepCost, counts_RE: np.ndarray, home_E: np.ndarray, alloc: np.ndarray, plan_s: float
) -> StepTime:
    """The predicted phases of an allocation that fetches nothing (static EP, the
    ``resident`` candidate) charged ``plan_s`` (``StepCost.step_time``'s numpy form: the
    same floats as :func:`_scores`, fewer calls for one allocation)."""
    none = np.zeros(alloc.shape, dtype=bool)
    return cost.scaled(plan_s=plan_s).step_time(alloc, counts_RE, none, home_E, planned=1)


def resident_pick(
    cost: StepCost | None,
    counts_RE: np.ndarray,
    prev_RB: np.ndarray | torch.Tensor | None,
    home_E: np.ndarray,
) -> tuple[np.ndarray, StepTime | None, int]:
    """int64 ``[E, R]``: the ``resident`` candidate (``reference._resident``): the
    diffusion rounded to whole records, or to whole tiles of ``cost.tile_rows`` where the
    step is predicted faster so (charged ``cost.exit_s``; ties: records); its predicted
    step so charged where both were scored (``None`` where only records were built: no
    cost, one-row tiles or no resident replica); and the rounds both builds ran."""
    prev = None if prev_RB is None else np.asarray(prev_RB)
    by_records, n = resident_host(counts_RE, prev, home_E, 1, cost)
    if cost is None or cost.tile_rows == 1 or prev is None or not (prev >= 0).any():
        return by_records, None, n
    at_records = _no_fetch_time(cost, counts_RE, home_E, by_records, cost.exit_s)
    by_tiles, m = resident_host(counts_RE, prev, home_E, cost.tile_rows, cost)
    at_tiles = _no_fetch_time(cost, counts_RE, home_E, by_tiles, cost.exit_s)
    if at_tiles.total_s < at_records.total_s:
        return by_tiles, at_tiles, n + m
    return by_records, at_records, n + m


def placed_host(total_E: np.ndarray, resident_ER: np.ndarray, home_E: np.ndarray) -> np.ndarray:
    """int64 ``[E, R]``: the ``placed`` candidate (``reference._placed``): each expert's
    records (``total_E``) on its lowest rank holding it resident away from home (bool
    ``resident_ER``), else on its home."""
    E, R = resident_ER.shape
    away_ER = resident_ER & (home_E[:, None] != np.arange(R)[None, :])
    server_E = np.where(away_ER.any(1), away_ER.argmax(1), home_E)
    alloc = np.zeros((E, R), dtype=np.int64)
    alloc[np.arange(E), server_E] = total_E
    return alloc


def _scores(
    cost: StepCost, hs: HostStep, alloc_CER: np.ndarray, resident: np.ndarray, plan_s: float
) -> torch.Tensor:
    """float64 ``[C]`` predicted step seconds, each charged ``plan_s`` (``resident`` all
    true: the free scores, nothing fetched)."""
    alloc = torch.from_numpy(np.ascontiguousarray(alloc_CER))
    R = alloc.shape[2]
    away_ER = hs.home[:, None] != np.arange(R)[None, :]
    fetch = torch.from_numpy((alloc_CER > 0) & away_ER & ~resident)
    plan_C = torch.full((alloc.shape[0],), plan_s, dtype=torch.float64)
    counts = torch.from_numpy(hs.counts)
    return batch_step_time(cost, counts, alloc, fetch, torch.from_numpy(hs.home), plan_C).total_s


def build_all(
    hs: HostStep, levels: int, resident: np.ndarray | None = None, cost: StepCost | None = None
) -> list[tuple[np.ndarray, list[Flow]]]:
    """Every candidate's :func:`build`, in table order; a construction towards targets
    (and a replay choice) already built is not built again (the same plan: levels whose
    caps round to the same targets, or equal the exact targets), nor the ``resident``
    candidate when the early exit built it (``resident``: its allocation; ``cost``: what
    picks its rounding)."""
    done: dict[tuple[tuple[int, ...], bool], tuple[np.ndarray, list[Flow]]] = {}
    caps = level_caps(hs.load, levels)
    out: list[tuple[np.ndarray, list[Flow]]] = []
    for c in table(levels):
        if c.kind == "resident" and resident is not None:
            out.append((resident, []))
            continue
        if not c.constructs:
            out.append(build(c, hs, levels, cost))
            continue
        target = _target(c, hs, caps)
        key = (tuple(target), c.kind != "greedy")
        if key not in done:
            done[key] = construct(hs, target, replay=key[1])[::-1]
        out.append(done[key])
    return out


def _target(c: Candidate, hs: HostStep, caps: list[int]) -> list[int]:
    """A construction candidate's per-rank targets (``caps``: the levels' caps)."""
    if c.kind == "level":
        return water_fill(hs.load, caps[c.level - 1])
    return targets_list(sum(hs.load), len(hs.load))


def build(
    c: Candidate, hs: HostStep, levels: int, cost: StepCost | None = None
) -> tuple[np.ndarray, list[Flow]]:
    """A candidate's allocation ``[E, R]`` and its construction's flows (reference's);
    ``cost``: what picks the ``resident`` candidate's rounding (:func:`resident_pick`)."""
    if c.kind == "static":
        return hs.static(), []
    if c.kind == "resident":
        return resident_pick(cost, hs.counts, hs.prev_RB, hs.home)[0], []
    if c.kind == "placed":
        return placed_host(hs.total, hs.resident, hs.home), []
    flows, alloc = construct(hs, _target(c, hs, level_caps(hs.load, levels)), c.kind != "greedy")
    return alloc, flows


def construct(hs: HostStep, target: list[int], replay: bool) -> tuple[list[Flow], np.ndarray]:
    """The group-flow construction towards ``target`` (with ``previous``'s flows and
    residents when ``replay``): its flows and allocation ``[E, R]``."""
    prev_RB, prev_F3 = (hs.prev_RB, hs.prev_F3) if replay else (None, None)
    warm = warm_maps(prev_RB, hs.home.tolist())
    flows = previous_flows(prev_F3)
    steps = host_moves(hs.load, target, hs.total.tolist(), hs.edges, warm, flows)
    return steps.flows, steps.alloc(hs.edges)


def layout(hs: HostStep, alloc_ER: np.ndarray, flows: list[Flow]) -> PlanFields:
    """The layout tensors of ``alloc_ER`` with ``flows`` recorded."""
    a = torch.from_numpy(np.ascontiguousarray(alloc_ER))
    fields = layout_torch(a, hs.num_slots, hs.align, hs.prev_RB)
    return fields._replace(flow=padded_flows(flows, a.shape[1]))
