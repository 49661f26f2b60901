"""A slot table's score over the window, every step at once, in torch ops.

Legend:
    S steps    R ranks    E experts    B slots per rank
    rows_SRE   int64 ``[S, R, E]`` the window's steps, each spread over the sources
    static_S   float64 ``[S]`` static EP's predicted seconds of each step (no planning)
    slot_RB    int64 ``[R, B]`` the table scored (``-1``: empty)

:func:`~moonplan.plan.residency.target.window_s` scores a table step by step on the host,
each step a few dozen small numpy calls. This form makes the same prediction with one set
of tensor operations over all ``S`` steps (``torch.vmap`` of :func:`served_torch`), built
from the planner's own torch forms (``links_torch``, ``nocopy_torch``, ``exit_bound_torch``,
``resident_pairs_torch``, ``placed_torch``, ``batch_step_time``), so the same code runs on
the host's CPU or on the device. Of its inputs only the slot table is read on the host
(whether it holds a replica, and its pairs of holders): no count is. The ``resident``
candidate is built for every step and the exit's gate only selects it: the result is the
host form's, float for float (``tests/plan/residency/test_window_torch.py``), and the work
is every step's build, not only those the gate lets through. Measured on this project's
CPU: 2.3-6.6x faster than ``window_s`` per table at EP 8, 0.75-0.87x at EP 64, where its
dense ``[E, R]`` step times outweigh the numpy calls (``docs/benchmarks.md``).
"""

from __future__ import annotations

import functools

import torch

from moonplan.plan.choice.bound import exit_bound_torch, links_torch, nocopy_torch
from moonplan.plan.choice.rent import call_price, exit_build_s
from moonplan.plan.choice.resident import holders_torch, resident_pairs_torch
from moonplan.plan.choice.tensor import placed_torch
from moonplan.plan.home import home_map
from moonplan.plan.torch_backend import resident_map
from moonplan.stepcost import StepCost
from moonplan.stepcost.batch import batch_step_time


def window_torch(
    cost: StepCost, rows_SRE: torch.Tensor, static_S: torch.Tensor, slot_RB: torch.Tensor
) -> torch.Tensor:
    """float64 ``[S]``: the predicted seconds of each step of ``rows_SRE`` served by
    ``slot_RB``, planning included (``target.served_s`` of each; summed in order on the
    host, they are ``target.window_s``)."""
    serve = functools.partial(served_torch, cost, slot_RB=slot_RB)
    return torch.vmap(serve)(rows_SRE, static_S)


def served_torch(
    cost: StepCost, counts_RE: torch.Tensor, static_s: torch.Tensor, slot_RB: torch.Tensor
) -> torch.Tensor:
    """float64 0-d: ``target.served_s`` of one step (int64 ``[R, E]``; ``static_s``: static
    EP's seconds of it, float64 0-d) served by ``slot_RB``, in torch ops."""
    R, E = counts_RE.shape
    home_E = home_map(E, R, counts_RE.device)
    resident_ER = resident_map(slot_RB, E)
    held = bool((slot_RB >= 0).any())
    links = links_torch(counts_RE, resident_ER, home_E, cost.domain_size(R))
    T_E = counts_RE.sum(0)
    t = cost.tile_rows
    totals = (((T_E + (t - 1)) // t * t).sum(), (T_E > 0).sum(), T_E.sum())
    best, exit_s = static_s, torch.full_like(static_s, cost.exit_s)
    if held:
        placed_s, built_s = _candidates(cost, counts_RE, slot_RB, resident_ER, home_E)
        best = torch.minimum(best, placed_s)
        nocopy = nocopy_torch(cost, R, totals, links, exit_build_s(cost))
        gate = best + cost.exit_s > nocopy
        best = torch.where(gate, torch.minimum(best, built_s), best)
        exit_s = torch.where(gate, exit_build_s(cost), exit_s)
    full = static_s + cost.plan_s
    held_t = torch.tensor(held, device=counts_RE.device)
    bound, _ = exit_bound_torch(cost, R, totals, links, full, held_t)
    return _planned(cost, best, exit_s, best + exit_s - bound)


def _candidates(
    cost: StepCost,
    counts_RE: torch.Tensor,
    slot_RB: torch.Tensor,
    resident_ER: torch.Tensor,
    home_E: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 0-d pair, no planning charged: the ``placed`` plan's seconds and the
    ``resident`` plan's (``choice.host.resident_pick``: whole tiles where the step is
    predicted faster so, charged ``cost.exit_s``; ties: records)."""
    E, R = resident_ER.shape
    T_E = counts_RE.sum(0)
    hold_ER = holders_torch(E, R, slot_RB, home_E)
    allocs = [placed_torch(T_E, resident_ER, home_E), resident_pairs_torch(counts_RE, hold_ER)]
    if cost.tile_rows > 1:
        allocs.append(resident_pairs_torch(counts_RE, hold_ER, cost.tile_rows))
        allocs += allocs[1:]  # the two roundings again, charged the exit's test
    alloc_CER = torch.stack(allocs)
    C = alloc_CER.shape[0]
    plan_C = torch.zeros(C, dtype=torch.float64, device=counts_RE.device)
    plan_C[3:] = cost.exit_s
    none_CER = torch.zeros(C, E, R, dtype=torch.bool, device=counts_RE.device)
    total_C = batch_step_time(cost, counts_RE, alloc_CER, none_CER, home_E, plan_C).total_s
    if C == 2:
        return total_C[0], total_C[1]
    return total_C[0], torch.where(total_C[4] < total_C[3], total_C[2], total_C[1])


def _planned(
    cost: StepCost, best: torch.Tensor, exit_s: torch.Tensor, over: torch.Tensor
) -> torch.Tensor:
    """``best`` plus its planning: the exit's ``exit_s`` where ``over <= 0`` (the plan is
    within the exit's bound), else ``target.calls_share``'s average."""
    n = torch.ceil(call_price(cost) / torch.where(over > 0, over, 1.0)).clamp(min=1)
    calls = ((n - 1) * exit_s + cost.plan_s) / n
    return best + torch.where(over > 0, calls, exit_s)
