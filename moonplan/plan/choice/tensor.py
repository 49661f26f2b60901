"""``policy="auto"`` in torch ops on any device, with no host read (CUDA-graph capturable).

Legend:
    R ranks    E experts    B slots    M = ceil(E/R)    K levels    C = K + 4 candidates
    alloc_CER  int64 [C, E, R] every candidate's allocation, in table order
    flow_CF3   int64 [C, R-1, 3] the flows each candidate's construction recorded

The same choice as :mod:`moonplan.plan.choice.reference`, bit for bit: every candidate is
built with the construction's masked tensor steps (``torch_backend.alloc_tensor``, a
fixed number of steps), scored in one :func:`~moonplan.stepcost.batch.batch_step_time`,
and the winner is selected and laid out by indexing with a device tensor. Shapes depend
only on ``(R, E, B, K)``. The early exit is decided here too, but only selects: with no
host read nothing can be skipped, so this form costs the full choice every step (the
CUDA kernel skips the constructions when it exits; :mod:`~moonplan.plan.choice.host` is
the CPU's fast form).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from moonplan.plan.choice.bound import (
    exit_bound_torch,
    experts_lb_torch,
    kept_section_torch,
    links_torch,
    nocopy_torch,
    totals_torch,
)
from moonplan.plan.choice.rent import call_price, exit_build_s, exit_rent_torch, settle_torch
from moonplan.plan.choice.resident import resident_torch
from moonplan.plan.choice.table import LEVELS, RESIDENT, table
from moonplan.plan.choice.targets import level_caps_torch, water_fill_torch
from moonplan.plan.from_alloc import home_layout, layout_torch
from moonplan.plan.placement import static_alloc
from moonplan.plan.plan_fields import PlanFields, no_flows
from moonplan.plan.torch_backend import Steps12Inputs, alloc_tensor, resident_map
from moonplan.stepcost.batch import BatchTime, batch_step_time
from moonplan.stepcost.step_cost import StepCost


def choose_tensor(
    counts_RE: torch.Tensor,
    num_slots: int,
    align: int,
    prev: tuple[torch.Tensor | None, torch.Tensor | None],
    cost: StepCost,
    levels: int = LEVELS,
    carried: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[PlanFields, tuple[torch.Tensor, ...]]:
    """The winner's layout tensors and ``(index 0-d, scores [C], exited 0-d, credit 0-d,
    pending 0-d, rounds 0-d)`` (``rounds``: of this call's ``resident`` build,
    ``Choice.rounds``), all on the counts' device (``carried``: ``previous``'s rent-or-buy
    credit and pending call, float64 0-d, ``rent.exit_rent``; ``None``: 0 each)."""
    R, E = counts_RE.shape
    dev = counts_RE.device
    prev_RB = prev[0]
    if carried is None:
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        carried = (zero, zero)
    home_E, ids_RM = home_layout(E, R, dev)
    T_E = counts_RE.sum(0)
    load_R = torch.zeros(R, dtype=torch.int64, device=dev).index_add_(0, home_E, T_E)
    resident_ER = _resident(prev_RB, E, R, dev)
    static_ER = static_alloc(counts_RE)
    times = functools.partial(_times, cost, counts_RE, home_E)
    homes = (load_R, T_E, home_E, ids_RM)
    records_ER, rounds = resident_torch(counts_RE, prev_RB, home_E, 1, cost)
    alloc_CER, flow_CF3 = _candidates(counts_RE, homes, prev, (resident_ER, records_ER), levels)
    tiles_ER = None  # with one-row tiles both roundings are one
    if cost.tile_rows > 1:  # built where replicas are resident (reference._resident)
        tiles_ER, more = resident_torch(counts_RE, prev_RB, home_E, cost.tile_rows, cost)
        rounds = rounds + torch.where(resident_ER.any(), more, 0)
    totals, links = _sums(cost, counts_RE, home_E, resident_ER)
    kept = kept_section_torch(cost, counts_RE, resident_ER, home_E)
    nocopy = nocopy_torch(cost, R, totals, links, exit_build_s(cost), kept)
    at_exit, exit_C, exit_index, built = _exit_times(
        times, alloc_CER, resident_ER, cost, tiles_ER, nocopy
    )
    static_full = times(static_ER[None], resident_ER, cost.plan_s).total_s[0]
    bounds = exit_bound_torch(cost, R, totals, links, static_full, resident_ER.any())
    gap = at_exit.experts_s - experts_lb_torch(cost, R, *totals)
    checking = call_price(cost)
    exited, credit, pending = exit_rent_torch(at_exit.total_s, gap, bounds, carried, checking)
    scores = times(alloc_CER, resident_ER, cost.plan_s).total_s
    free = times(alloc_CER, torch.ones_like(resident_ER), cost.plan_s).total_s
    index, settled = settle_torch(scores, free, credit)
    scores = torch.where(exited, exit_C, scores)
    index = torch.where(exited, exit_index, index)
    pick = index.view(1)
    alloc_ER = alloc_CER.index_select(0, pick)[0]
    fields = layout_torch(alloc_ER, num_slots, align, prev_RB, host=False)
    fields = fields._replace(flow=flow_CF3.index_select(0, pick)[0])
    made = (index, scores, exited, torch.where(exited, credit, settled), pending)
    return fields, (*made, torch.where(built | ~exited, rounds, 0))  # Choice.rounds


class _AtExit(NamedTuple):
    """The exit's plan: its predicted step and experts phase (float64 0-d)."""

    total_s: torch.Tensor
    experts_s: torch.Tensor


def _exit_times(
    times: Callable[[torch.Tensor, torch.Tensor, float], BatchTime],
    alloc_CER: torch.Tensor,
    resident_ER: torch.Tensor,
    cost: StepCost,
    tiles_ER: torch.Tensor | None,
    nocopy: torch.Tensor,
) -> tuple[_AtExit, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The early exit's plan, ``(its times, the exit's scores [C], its index int64 0-d,
    whether it built resident bool 0-d)``:
    the least (ties: the earlier entry) of static EP and, where replicas are resident,
    ``placed`` and ``resident`` where the better of the two is above ``nocopy``
    (``bound.nocopy_torch``), each charged ``cost.exit_s``; ``inf`` elsewhere.

    ``tiles_ER``: the ``resident`` candidate rounded to whole tiles, timed in the same call;
    ``alloc_CER``'s ``resident`` entry (rounded to records) becomes it where it is predicted
    faster (ties: records; ``reference._resident``)."""
    C, dev = alloc_CER.shape[0], alloc_CER.device
    cheap = times(alloc_CER[[0, C - 1]], resident_ER, cost.exit_s)
    res = alloc_CER[[RESIDENT]] if tiles_ER is None else torch.stack([alloc_CER[2], tiles_ER])
    t = times(res, resident_ER, cost.exit_s)
    at = torch.zeros((), dtype=torch.int64, device=dev)  # records, or tiles where faster
    if tiles_ER is not None:
        tiles = t.total_s[1] < t.total_s[0]
        alloc_CER[RESIDENT] = torch.where(tiles, tiles_ER, alloc_CER[RESIDENT])
        at = torch.where(tiles, 1, 0)
    has = resident_ER.any()
    t_placed = torch.where(has, cheap.total_s[1], torch.inf)
    built = has & (torch.minimum(cheap.total_s[0], t_placed) > nocopy)
    t_res = torch.where(built, t.total_s.gather(0, at.view(1))[0], torch.inf)
    total_3 = torch.stack([cheap.total_s[0], t_res, t_placed])  # table order
    experts_3 = torch.stack([cheap.experts_s[0], t.experts_s.gather(0, at.view(1))[0],
                             cheap.experts_s[1]])  # fmt: skip
    pick = torch.argmin(total_3)  # the first least
    index = torch.tensor([0, RESIDENT, C - 1], device=dev).gather(0, pick.view(1))[0]
    c_C = torch.arange(C, device=dev)
    exit_C = torch.where(c_C == 0, total_3[0], torch.inf)
    exit_C = torch.where(c_C == RESIDENT, t_res, torch.where(c_C == C - 1, t_placed, exit_C))
    at_exit = _AtExit(total_3.gather(0, pick.view(1))[0], experts_3.gather(0, pick.view(1))[0])
    return at_exit, exit_C, index, built


def _resident(prev_RB: torch.Tensor | None, E: int, R: int, dev: torch.device) -> torch.Tensor:
    """bool ``[E, R]`` resident pairs (none without ``previous``)."""
    if prev_RB is None:
        return torch.zeros(E, R, dtype=torch.bool, device=dev)
    return resident_map(prev_RB, E)


def _times(
    cost: StepCost,
    counts_RE: torch.Tensor,
    home_E: torch.Tensor,
    alloc_CER: torch.Tensor,
    resident_ER: torch.Tensor,
    plan_s: float,
) -> BatchTime:
    """The predicted step (``total_s``: float64 ``[C]`` seconds) and its phases of each
    allocation in ``alloc_CER``, each charged ``plan_s``; ``resident_ER`` (bool) pairs
    are not fetched."""
    R = alloc_CER.shape[2]
    away_ER = home_E[:, None] != torch.arange(R, device=home_E.device)[None, :]
    fetch_CER = (alloc_CER > 0) & (away_ER & ~resident_ER)
    plan_C = torch.full((alloc_CER.shape[0],), plan_s, dtype=torch.float64, device=home_E.device)
    return batch_step_time(cost, counts_RE, alloc_CER, fetch_CER, home_E, plan_C)


def _sums(
    cost: StepCost, counts_RE: torch.Tensor, home_E: torch.Tensor, resident_ER: torch.Tensor
) -> tuple[
    tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]:
    """The bound's int64 ``totals`` (0-d each) and ``links`` (``bound.links_torch``)."""
    R = resident_ER.shape[1]
    totals = totals_torch(cost, counts_RE.sum(0))
    return totals, links_torch(counts_RE, resident_ER, home_E, cost.domain_size(R))


def _candidates(
    counts_RE: torch.Tensor,
    homes: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    prev: tuple[torch.Tensor | None, torch.Tensor | None],
    resident: tuple[torch.Tensor, torch.Tensor],
    levels: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(alloc_CER, flow_CF3)`` of every candidate, in table order (``resident``: bool
    ``[E, R]``, the pairs resident in ``previous``'s slots, and the ``resident`` candidate
    rounded to whole records, which :func:`_exit_times` may replace with its whole
    tiles)."""
    resident_ER, records_ER = resident
    load_R, T_E, home_E, ids_RM = homes
    R = counts_RE.shape[0]
    N = T_E.sum()
    exact_R = N // R + (torch.arange(R, device=T_E.device) < N % R).to(torch.int64)
    level_KR = water_fill_torch(load_R, level_caps_torch(load_R, levels))

    def build(target_R: torch.Tensor, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
        prev_RB, prev_F3 = prev if replay else (None, None)
        step = Steps12Inputs(load_R, target_R, T_E, home_E, prev_RB, prev_F3)
        _, flow_F3, alloc_ER = alloc_tensor(step, ids_RM, stop_early=False)
        return alloc_ER, flow_F3

    static_ER = static_alloc(counts_RE)
    none_F3 = no_flows(R, T_E.device)
    exact = build(exact_R, True)
    out = {"exact": exact, "greedy": build(exact_R, False), "static": (static_ER, none_F3)}
    out["resident"] = (records_ER, none_F3)
    out["placed"] = (placed_torch(T_E, resident_ER, home_E), none_F3)
    for k in range(1, levels):
        out[f"level-{k}"] = build(level_KR[k - 1], True)
    allocs, flows = zip(*(out[c.name] for c in table(levels)), strict=True)
    return torch.stack(allocs), torch.stack(flows)


def placed_torch(
    T_E: torch.Tensor, resident_ER: torch.Tensor, home_E: torch.Tensor
) -> torch.Tensor:
    """int64 ``[E, R]``: the ``placed`` candidate (``reference._placed``) of the records per
    expert ``T_E``, the resident pairs (bool ``resident_ER``) and the homes, no host read."""
    E, R = resident_ER.shape
    away_ER = resident_ER & (home_E[:, None] != torch.arange(R, device=T_E.device)[None, :])
    first_E = away_ER.to(torch.int8).argmax(1)  # the first True where any
    server_E = torch.where(away_ER.any(1), first_E, home_E)
    alloc_ER = torch.zeros(E, R, dtype=torch.int64, device=T_E.device)
    return alloc_ER.scatter(1, server_E[:, None], T_E[:, None])
