"""Slot tables' scores over the window, every step and every table at once, in torch ops.

Legend:
    S steps    R ranks    E experts    B slots per rank    T tables    C candidates
    rows_SRE   int64 ``[S, R, E]`` the window's steps, each spread over the sources
    static_S   float64 ``[S]`` static EP's predicted seconds of each step (no planning)
    slot_TRB   int64 ``[T, R, B]`` the tables scored (``-1``: empty)

:func:`~moonplan.plan.residency.target.window_s` scores a table step by step on the host,
each step a few dozen small numpy calls. This form makes the same prediction for every
table with one set of tensor operations over all ``S`` steps (``torch.vmap`` of
:func:`served_tables`), built from the planner's own torch forms (``links_torch``,
``nocopy_torch``, ``exit_bound_torch``, ``resident_tables_torch``, ``placed_torch``,
``batch_step_time``), so the same code runs on the host's CPU or on the device. The tables
with replicas share one call: their ``resident`` rounds run together (no pair joins two
tables) and their candidates are scored in one ``batch_step_time``; the table-wise parts
are an inner ``torch.vmap`` over the tables. A table without replicas is static EP and its
planning, the same for every such table, scored once. Of its inputs only the slot tables
are read on the host (whether each holds a replica, and its pairs of holders): no count
is. The ``resident`` candidate is built for every step and the exit's gate only selects
it: the result is the host form's, float for float
(``tests/plan/residency/test_window_torch.py``), and the work is every step's build, not
only those the gate lets through. Measured on this project's CPU in
``docs/benchmarks.md`` (``bench/bench_decision.py``).
"""

from __future__ import annotations

import functools

import torch

from moonplan.plan.choice.bound import (
    exit_bound_torch,
    kept_section_torch,
    links_torch,
    nocopy_torch,
    totals_torch,
)
from moonplan.plan.choice.rent import call_price, exit_build_s
from moonplan.plan.choice.resident import holders_torch, resident_tables_torch
from moonplan.plan.choice.tensor import placed_torch
from moonplan.plan.home import home_map
from moonplan.plan.placement import static_alloc
from moonplan.plan.torch_backend import resident_map
from moonplan.stepcost import StepCost
from moonplan.stepcost.batch import batch_step_time


def window_torch(
    cost: StepCost, rows_SRE: torch.Tensor, static_S: torch.Tensor, slot_RB: torch.Tensor
) -> torch.Tensor:
    """float64 ``[S]``: the predicted seconds of each step of ``rows_SRE`` served by
    ``slot_RB`` (int64 ``[R, B]``), planning included (``target.served_s`` of each; summed in
    order on the host, they are ``target.window_s``)."""
    return windows_torch(cost, rows_SRE, static_S, slot_RB[None])[0]


def windows_torch(
    cost: StepCost, rows_SRE: torch.Tensor, static_S: torch.Tensor, slot_TRB: torch.Tensor
) -> torch.Tensor:
    """float64 ``[T, S]``: :func:`window_torch` of each table of ``slot_TRB``."""
    T, S = slot_TRB.shape[0], rows_SRE.shape[0]
    held = [int(t) for t in (slot_TRB >= 0).flatten(1).any(1).nonzero().flatten().tolist()]
    out_TS = torch.empty(T, S, dtype=torch.float64, device=rows_SRE.device)
    if len(held) < T:
        out_TS[:] = torch.vmap(functools.partial(_served_empty, cost))(rows_SRE, static_S)
    if held:
        E = rows_SRE.shape[2]
        serve = functools.partial(served_tables, cost, tables=_tables(slot_TRB[held], E))
        out_TS[held] = torch.vmap(serve)(rows_SRE, static_S).t()
    return out_TS


def _tables(slot_TRB: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bool ``[T, E, R]`` each: the resident pairs and the holders of each table."""
    R = slot_TRB.shape[1]
    home_E = home_map(E, R, slot_TRB.device)
    resident_TER = torch.stack([resident_map(s_RB, E) for s_RB in slot_TRB])
    hold_TER = torch.stack([holders_torch(E, R, s_RB, home_E) for s_RB in slot_TRB])
    return resident_TER, hold_TER


def static_torch(cost: StepCost, rows_SRE: torch.Tensor) -> torch.Tensor:
    """float64 ``[S]``: static EP's predicted seconds of each step of ``rows_SRE``, no
    planning charged (``target.step_time_over`` over empty slots, float for float)."""
    return torch.vmap(functools.partial(_static_s, cost))(rows_SRE)


def _static_s(cost: StepCost, counts_RE: torch.Tensor) -> torch.Tensor:
    """float64 0-d: static EP's seconds of one step (int64 ``[R, E]``): every record of an
    expert on its home."""
    R, E = counts_RE.shape
    home_E = home_map(E, R, counts_RE.device)
    alloc_1ER = static_alloc(counts_RE)[None]
    plan_1 = torch.zeros(1, dtype=torch.float64, device=counts_RE.device)
    return batch_step_time(cost, counts_RE, alloc_1ER, None, home_E, plan_1).total_s[0]


def _served_empty(cost: StepCost, counts_RE: torch.Tensor, static_s: torch.Tensor) -> torch.Tensor:
    """float64 0-d: ``target.served_s`` of one step served by slots without a replica:
    static EP, and the exit's test or the full calls it makes."""
    R, E = counts_RE.shape
    home_E = home_map(E, R, counts_RE.device)
    none_ER = torch.zeros(E, R, dtype=torch.bool, device=counts_RE.device)
    links = links_torch(counts_RE, none_ER, home_E, cost.domain_size(R))
    exit_s = torch.full_like(static_s, cost.exit_s)
    held = torch.zeros((), dtype=torch.bool, device=counts_RE.device)
    full = static_s + cost.plan_s
    bound, _ = exit_bound_torch(cost, R, totals_torch(cost, counts_RE.sum(0)), links, full, held)
    return _planned(cost, static_s, exit_s, static_s + exit_s - bound)


def served_tables(
    cost: StepCost,
    counts_RE: torch.Tensor,
    static_s: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """float64 ``[T]``: ``target.served_s`` of one step (int64 ``[R, E]``; ``static_s``:
    static EP's seconds of it, float64 0-d) served by each of ``T`` tables with replicas
    (``tables``: their resident pairs and holders, :func:`_tables`), in torch ops."""
    R, E = counts_RE.shape
    resident_TER, _ = tables
    home_E = home_map(E, R, counts_RE.device)
    G, totals = cost.domain_size(R), totals_torch(cost, counts_RE.sum(0))
    links_of = torch.vmap(links_torch, in_dims=(None, 0, None, None))
    links = links_of(counts_RE, resident_TER, home_E, G)
    placed_T, built_T = _candidates(cost, counts_RE, tables, home_E)
    best = torch.minimum(static_s, placed_T)
    kept_of = torch.vmap(kept_section_torch, in_dims=(None, None, 0, None))
    kept_T = kept_of(cost, counts_RE, resident_TER, home_E)
    nocopy_of = torch.vmap(lambda lk, kept_s: nocopy_torch(cost, R, totals, lk, build_s, kept_s))
    build_s = exit_build_s(cost)
    gate = best + cost.exit_s > nocopy_of(links, kept_T)
    best = torch.where(gate, torch.minimum(best, built_T), best)
    exit_s = torch.where(gate, exit_build_s(cost), torch.full_like(best, cost.exit_s))
    held = torch.ones((), dtype=torch.bool, device=counts_RE.device)
    full = static_s + cost.plan_s
    bound_of = torch.vmap(lambda lk: exit_bound_torch(cost, R, totals, lk, full, held)[0])
    return _planned(cost, best, exit_s, best + exit_s - bound_of(links))


def _candidates(
    cost: StepCost,
    counts_RE: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    home_E: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[T]`` pair, no planning charged: each table's ``placed`` plan's seconds
    and its ``resident`` plan's (``choice.host.resident_pick``: whole tiles where the step
    is predicted faster so, charged ``cost.exit_s``; ties: records)."""
    resident_TER, hold_TER = tables
    T, E, R = resident_TER.shape
    T_E = counts_RE.sum(0)
    placed_TER = torch.vmap(placed_torch, in_dims=(None, 0, None))(T_E, resident_TER, home_E)
    allocs = [placed_TER, resident_tables_torch(counts_RE, hold_TER)]
    if cost.tile_rows > 1:
        allocs.append(resident_tables_torch(counts_RE, hold_TER, cost.tile_rows))
    C = len(allocs)
    alloc_XER = torch.stack(allocs, 1).reshape(T * C, E, R)  # table by table
    plan_PX = torch.zeros(2, T * C, dtype=torch.float64, device=counts_RE.device)
    plan_PX[1] = cost.exit_s  # the two roundings compared charged the exit's test
    total = batch_step_time(cost, counts_RE, alloc_XER, None, home_E, plan_PX).total_s
    total_PTC = total.reshape(2, T, C)
    if C == 2:
        return total_PTC[0, :, 0], total_PTC[0, :, 1]
    tiles_T = total_PTC[1, :, 2] < total_PTC[1, :, 1]
    return total_PTC[0, :, 0], torch.where(tiles_T, total_PTC[0, :, 2], total_PTC[0, :, 1])


def _planned(
    cost: StepCost, best: torch.Tensor, exit_s: torch.Tensor, over: torch.Tensor
) -> torch.Tensor:
    """``best`` plus its planning: the exit's ``exit_s`` where ``over <= 0`` (the plan is
    within the exit's bound), else ``target.calls_share``'s average."""
    n = torch.ceil(call_price(cost) / torch.where(over > 0, over, 1.0)).clamp(min=1)
    calls = ((n - 1) * exit_s + cost.plan_s) / n
    return best + torch.where(over > 0, calls, exit_s)
