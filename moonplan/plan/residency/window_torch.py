"""Slot tables' scores over the window, every step and every table at once, in torch ops.

Legend:
    S steps    R ranks    E experts    B slots per rank    T tables    C candidates
    rows_SRE   int64 ``[S, R, E]`` the window's steps, each spread over the sources
    static_S   float64 ``[S]`` static EP's predicted seconds of each step (no planning)
    slot_TRB   int64 ``[T, R, B]`` the tables scored (``-1``: empty)

:func:`~moonplan.plan.residency.target.window_s` scores a table step by step on the host,
each step a few dozen small numpy calls. This form makes the same prediction for every
table with a few sets of tensor operations over all ``S`` steps, built from the
planner's own torch forms (``links_torch``, ``nocopy_torch``, ``exit_bound_torch``,
``resident_tables_torch``, ``placed_torch``, ``batch_step_time``), so the same code runs
on the host's CPU or on the device:

1. **Without the build** (:func:`unbuilt_tables`, a ``torch.vmap`` over the steps, an
   inner one over the tables): each (step, table)'s links, ``placed`` plan, the exit's
   bound and its gate (whether the ``resident`` build could beat the better of static EP
   and ``placed``: ``bound.nocopy_s``).
2. **The builds** (:func:`built_s`): the ``resident`` candidate of only the (step, table)
   entries the gate lets through, all in one call (each entry a table of its own with its
   step's counts: no pair joins two entries). The gate is read on the host to gather
   them. Elsewhere the host form does not build either, so the result is the host form's,
   float for float (``tests/plan/residency/test_window_torch.py``), and the work is the
   builds the gate lets through (``moonplan.plan.residency.work`` counts both parts).

A table without replicas is static EP and its planning, the same for every such table,
scored once. Measured on this project's CPU in ``docs/benchmarks.md``
(``bench/bench_decision.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from moonplan.plan.choice.bound import (
    exit_bound_torch,
    kept_section_torch,
    links_torch,
    nocopy_torch,
    totals_torch,
)
from moonplan.plan.choice.rent import call_price, call_rounds_s, exit_build_s, roundings
from moonplan.plan.choice.resident import holders_torch, resident_tables_torch
from moonplan.plan.choice.tensor import placed_torch
from moonplan.plan.home import home_map
from moonplan.plan.placement import static_alloc
from moonplan.plan.residency.serving import LOOKUPS, lookup_alloc
from moonplan.plan.residency.shares import weighted_alloc
from moonplan.plan.residency.work import Builds
from moonplan.plan.torch_backend import resident_map
from moonplan.stepcost import StepCost
from moonplan.stepcost.batch import BatchTime, batch_step_time
from moonplan.stepcost.training import backward_s


def window_torch(
    cost: StepCost, rows_SRE: torch.Tensor, static_S: torch.Tensor, slot_RB: torch.Tensor
) -> torch.Tensor:
    """float64 ``[S]``: the predicted seconds of each step of ``rows_SRE`` served by
    ``slot_RB`` (int64 ``[R, B]``), planning included (``target.served_s`` of each; summed in
    order on the host, they are ``target.window_s``)."""
    return windows_torch(cost, rows_SRE, static_S, slot_RB[None])[0]


def windows_torch(
    cost: StepCost,
    rows_SRE: torch.Tensor,
    static_S: torch.Tensor,
    slot_TRB: torch.Tensor,
    builds: Builds | None = None,
) -> torch.Tensor:
    """float64 ``[T, S]``: :func:`window_torch` of each table of ``slot_TRB``; ``builds``
    counts the work (``moonplan.plan.residency.work``): each step of the tables with
    replicas and of the empty one (scored once), and the builds the gate lets through."""
    T, S = slot_TRB.shape[0], rows_SRE.shape[0]
    held = [int(t) for t in (slot_TRB >= 0).flatten(1).any(1).nonzero().flatten().tolist()]
    out_TS = torch.empty(T, S, dtype=torch.float64, device=rows_SRE.device)
    if len(held) < T:
        out_TS[:] = torch.vmap(functools.partial(_served_empty, cost))(rows_SRE, static_S)
        if builds is not None:
            builds.scored += S
    if held:
        E = rows_SRE.shape[2]
        tables = tables_of(slot_TRB[held], E)
        out_TS[held] = served_tables(cost, rows_SRE, static_S, tables, builds).t()
    return out_TS


def lookups_torch(
    cost: StepCost,
    rows_SRE: torch.Tensor,
    slot_TRB: torch.Tensor,
    builds: Builds | None = None,
    weights_STER: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 ``[L, T, S]``: each step of ``rows_SRE`` served by each table's lookup plans
    (``serving.lookup_plan``, in ``serving.LOOKUPS`` order, then, given each step's
    weights ``weights_STER`` (int64 ``[S, T, E, R]``), the weighted lookup,
    ``serving.weighted_plan``), no planning charged: what ``auto`` serves where planner
    calls do not pay. Over an empty table they are static EP, float for float
    (:func:`static_torch`). ``builds`` counts the ``L * T * S`` entries."""
    S, R, E = rows_SRE.shape
    home_E = home_map(E, R, rows_SRE.device)
    resident_TER = torch.stack([resident_map(s_RB, E) for s_RB in slot_TRB])
    plan_1T = torch.zeros(1, len(slot_TRB), dtype=torch.float64, device=rows_SRE.device)
    out = []
    for how in LOOKUPS:
        alloc_of = torch.vmap(functools.partial(lookup_alloc, how), in_dims=(None, 0))

        def one(counts_RE: torch.Tensor, alloc_of: Callable = alloc_of) -> torch.Tensor:
            alloc_TER = alloc_of(counts_RE.sum(0), resident_TER)
            return batch_step_time(cost, counts_RE, alloc_TER, None, home_E, plan_1T).total_s[0]

        out.append(torch.vmap(one)(rows_SRE).t())
    if weights_STER is not None:
        weigh = torch.vmap(weighted_alloc, in_dims=(None, 0))

        def one_w(counts_RE: torch.Tensor, w_TER: torch.Tensor) -> torch.Tensor:
            alloc_TER = weigh(counts_RE.sum(0), w_TER)
            return batch_step_time(cost, counts_RE, alloc_TER, None, home_E, plan_1T).total_s[0]

        out.append(torch.vmap(one_w)(rows_SRE, weights_STER.to(rows_SRE.device)).t())
    if builds is not None:
        builds.scored += len(out) * len(slot_TRB) * S
    return torch.stack(out)


def tables_of(slot_TRB: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    return _static_time(cost, counts_RE).total_s[0]


def _static_time(cost: StepCost, counts_RE: torch.Tensor) -> BatchTime:
    """Static EP's phases of one step (int64 ``[R, E]``), one candidate."""
    R, E = counts_RE.shape
    home_E = home_map(E, R, counts_RE.device)
    alloc_1ER = static_alloc(counts_RE)[None]
    plan_1 = torch.zeros(1, dtype=torch.float64, device=counts_RE.device)
    return batch_step_time(cost, counts_RE, alloc_1ER, None, home_E, plan_1)


def static_training_torch(
    cost: StepCost, rows_SRE: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[S]`` each, from one scoring of each step of ``rows_SRE``: static EP's
    forward seconds (:func:`static_torch`, float for float) and its backward's
    (``moonplan.stepcost.training.backward_s``: its dispatch, twice its experts phase, its
    combine; nothing is fetched)."""

    def one(counts_RE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = _static_time(cost, counts_RE)
        return t.total_s[0], backward_s(t)[0]

    forward_S, backward_S = torch.vmap(one)(rows_SRE)
    return forward_S, backward_S


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
    call_s = torch.full_like(static_s, call_rounds_s(cost, 1))  # the call's records build
    return _planned(cost, static_s, (exit_s, call_s), static_s + exit_s - bound)


def served_tables(
    cost: StepCost,
    rows_SRE: torch.Tensor,
    static_S: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    builds: Builds | None = None,
) -> torch.Tensor:
    """float64 ``[S, T]``: ``target.served_s`` of each step of ``rows_SRE`` (``static_S``:
    static EP's seconds of each) served by each of ``T`` tables with replicas (``tables``:
    their resident pairs and holders, :func:`tables_of`), in torch ops. The ``resident``
    candidate is built only for the (step, table) entries the exit's gate lets through,
    all in one call (the gate is read on the host); ``builds`` counts them, and the
    ``S * T`` entries scored."""
    _, hold_TER = tables
    best_ST, gate_ST, bound_ST = unbuilt_tables(cost, rows_SRE, static_S, tables)
    s_N, t_N = gate_ST.nonzero(as_tuple=True)
    if builds is not None:
        builds.scored += gate_ST.numel()
        builds.made += len(s_N)
    exit_ST = torch.full_like(best_ST, cost.exit_s)
    call_ST = torch.full_like(best_ST, call_rounds_s(cost, roundings(cost)))  # its least build
    if len(s_N):
        built_N, rounds_N = built_s(cost, rows_SRE[s_N], hold_TER[t_N])
        best_ST = best_ST.index_put((s_N, t_N), torch.minimum(best_ST[s_N, t_N], built_N))
        ran_N = rounds_N.to(torch.float64) * cost.round_s
        exit_ST = exit_ST.index_put((s_N, t_N), cost.exit_s + ran_N)  # rent.exit_rounds_s
        call_ST = call_ST.index_put((s_N, t_N), cost.plan_s + ran_N)  # rent.call_rounds_s
    over_ST = best_ST + cost.exit_s - bound_ST  # the exit weighs its plan with its test alone
    return _planned(cost, best_ST, (exit_ST, call_ST), over_ST)


def unbuilt_tables(
    cost: StepCost,
    rows_SRE: torch.Tensor,
    static_S: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_unbuilt` of every step (``[S, T]`` each): the scores without the build."""
    home_E = home_map(rows_SRE.shape[2], rows_SRE.shape[1], rows_SRE.device)
    unbuilt = functools.partial(_unbuilt, cost, tables=tables, home_E=home_E)
    return torch.vmap(unbuilt)(rows_SRE, static_S)


def _unbuilt(
    cost: StepCost,
    counts_RE: torch.Tensor,
    static_s: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    home_E: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What each of ``T`` tables gives one step (int64 ``[R, E]``) without the ``resident``
    build: float64 ``[T]`` the better of static EP and ``placed``, bool ``[T]`` the exit's
    gate (the build could beat it), float64 ``[T]`` the exit's bound."""
    R = counts_RE.shape[0]
    resident_TER, _ = tables
    G, totals = cost.domain_size(R), totals_torch(cost, counts_RE.sum(0))
    links_of = torch.vmap(links_torch, in_dims=(None, 0, None, None))
    links = links_of(counts_RE, resident_TER, home_E, G)
    placed_TER = torch.vmap(placed_torch, in_dims=(None, 0, None))(
        counts_RE.sum(0), resident_TER, home_E
    )
    plan_1T = torch.zeros(1, len(placed_TER), dtype=torch.float64, device=counts_RE.device)
    placed_T = batch_step_time(cost, counts_RE, placed_TER, None, home_E, plan_1T).total_s[0]
    best = torch.minimum(static_s, placed_T)
    kept_of = torch.vmap(kept_section_torch, in_dims=(None, None, 0, None))
    kept_T = kept_of(cost, counts_RE, resident_TER, home_E)
    build_s = exit_build_s(cost)
    nocopy_of = torch.vmap(lambda lk, kept_s: nocopy_torch(cost, R, totals, lk, build_s, kept_s))
    gate = best + cost.exit_s > nocopy_of(links, kept_T)
    held = torch.ones((), dtype=torch.bool, device=counts_RE.device)
    full = static_s + cost.plan_s
    bound_of = torch.vmap(lambda lk: exit_bound_torch(cost, R, totals, lk, full, held)[0])
    return best, gate, bound_of(links)


def built_s(
    cost: StepCost, rows_NRE: torch.Tensor, hold_NER: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[N]``: the ``resident`` plan's seconds of each entry (its step's counts,
    int64 ``[N, R, E]``, and its table's holders, bool ``[N, E, R]``), no planning
    charged (``choice.host.resident_pick``: whole tiles where the step is predicted
    faster so, charged ``cost.exit_s``; ties: records); and int64 ``[N]`` the rounds its
    builds ran (both roundings)."""
    home_E = home_map(rows_NRE.shape[2], rows_NRE.shape[1], rows_NRE.device)
    allocs, rounds_N = [], torch.zeros(len(rows_NRE), dtype=torch.int64, device=rows_NRE.device)
    for tile in (1, cost.tile_rows) if cost.tile_rows > 1 else (1,):
        alloc_NER, ran_N = resident_tables_torch(rows_NRE, hold_NER, tile, cost)
        allocs.append(alloc_NER)
        rounds_N = rounds_N + ran_N
    C = len(allocs)
    alloc_NCER = torch.stack(allocs, 1)
    plan_PC = torch.zeros(2, C, dtype=torch.float64, device=rows_NRE.device)
    plan_PC[1] = cost.exit_s  # the two roundings compared charged the exit's test
    step = functools.partial(_step_totals, cost, home_E=home_E, plan_PC=plan_PC)
    total_NPC = torch.vmap(step)(rows_NRE, alloc_NCER)
    if C == 1:
        return total_NPC[:, 0, 0], rounds_N
    tiles_N = total_NPC[:, 1, 1] < total_NPC[:, 1, 0]
    return torch.where(tiles_N, total_NPC[:, 0, 1], total_NPC[:, 0, 0]), rounds_N


def _step_totals(
    cost: StepCost,
    counts_RE: torch.Tensor,
    alloc_CER: torch.Tensor,
    home_E: torch.Tensor,
    plan_PC: torch.Tensor,
) -> torch.Tensor:
    """float64 ``[P, C]``: ``batch_step_time``'s totals of one step's ``C`` allocations."""
    return batch_step_time(cost, counts_RE, alloc_CER, None, home_E, plan_PC).total_s


def _planned(
    cost: StepCost,
    best: torch.Tensor,
    charges: tuple[torch.Tensor, torch.Tensor],
    over: torch.Tensor,
) -> torch.Tensor:
    """``best`` plus its planning (``charges``: an exit's and a full call's, float64 each):
    the exit's where ``over <= 0`` (the plan charged its test is within the exit's bound),
    else ``target.calls_share``'s average."""
    exit_s, call_s = charges
    n = torch.ceil(call_price(cost) / torch.where(over > 0, over, 1.0)).clamp(min=1)
    calls = ((n - 1) * exit_s + call_s) / n
    return best + torch.where(over > 0, calls, exit_s)
