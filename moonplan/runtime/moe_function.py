"""The MoE step as an autograd function: backward replays the forward plan.

Legend:
    R ranks, S tokens, K top-k, N = S*K records, H hidden, P receive rows of this rank,
    M home rows, B slots, D direct rows, W = M + B + D rows, E_r home experts of this rank

All rows move through the runtime's transport
(:class:`~moonplan.runtime.transports.base.Transport`); this module never touches
a buffer. Forward: ``dispatch`` token rows -> experts on the receive rows ->
``combine`` (``y = sum_k w * o``, fp32). The weight prefetch (new slots and
direct rows) was started before the dispatch (``MoEStep.fetch``, see
:mod:`moonplan.runtime.background`): the experts run the home rows first and wait
for it only before the slot and direct rows. Backward (same plan and route,
no re-planning, no counts exchange): ``combine_backward`` gives the receive rows'
output gradients and ``dweight``; the experts' backward gives the receive rows'
input gradients and the weight gradients; ``dispatch_backward`` brings the input
gradients back to their tokens, summed over ``k``; replica-row weight gradients
go to their home rank (:class:`~moonplan.runtime.store.GradReducer`); on a
one-sided transport with a background lane, the reduce's peer reads run while
the dispatch-backward moves rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from moonplan.plan.plan_type import Plan
from moonplan.plan.route import Route
from moonplan.runtime.background import Pending
from moonplan.runtime.rank_experts import run_sections
from moonplan.runtime.step_context import StepContext
from moonplan.runtime.step_hooks import StepClock
from moonplan.runtime.store import PROJECTIONS
from moonplan.runtime.transports.base import StepState


@dataclass
class MoEStep:
    """What forward and backward of one step share: the layer objects it runs on
    (``context``), its plan, this rank's row offsets under it (``plan.row_offset[rank]``,
    ``W + 1`` host integers, read with the plan's rows: the expert sections' bounds) and
    route, and its clock (phase times and profiler hooks)."""

    context: StepContext
    plan: Plan
    row_offset: tuple[int, ...]
    route: Route
    clock: StepClock = field(default_factory=StepClock)
    # The prefetch, (slot rows copied, direct weights per projection); None: nothing to copy.
    fetch: Pending | None = None
    traffic: dict[str, int] = field(default_factory=dict)  # the transport's StepState.traffic


def _remote_sections(step: MoEStep, remote: dict[str, torch.Tensor]) -> list:
    M, B = step.context.home_rows, step.context.slots
    return [
        (M, remote["slot_gate_up"], remote["slot_down"]),
        (M + B, remote["direct_gate_up"], remote["direct_down"]),
    ]


def _alias(w: torch.Tensor) -> torch.Tensor:
    """A tensor over ``w``'s memory with its own version counter.

    Views of the heap share one version counter, so writes to other buffers of the
    heap (receive rows, outputs) would look like writes to the slot rows saved for
    backward. The slot rows themselves do not change until the next forward.
    """
    out = torch.empty(0, dtype=w.dtype, device=w.device)
    return out.set_(w.untyped_storage(), w.storage_offset(), w.size(), w.stride())


def _wait_prefetch(step: MoEStep, t0: float) -> float:
    """Wait for the step's background prefetch job before the slot rows: the exposed
    wait, phase ``prefetch_exposed`` from ``t0`` (perf_counter) to now. Without a
    background job (nothing to copy, or it ran inline when it started) nothing is waited
    for: a span of length 0. Returns where the next phase starts."""
    if step.fetch is None or step.fetch.done:
        step.clock.span("prefetch_exposed", t0, t0)
        return t0
    step.fetch.wait()
    return step.clock.tick("prefetch_exposed", t0)


def _remote_weights(step: MoEStep) -> dict[str, torch.Tensor]:
    """This rank's slot rows (``[B, ...]``, views of the store: no copy) and direct rows
    (``[D, ...]``, read from their home ranks), per projection, once the prefetch is done
    (no prefetch, ``step.fetch is None``: nothing was copied, no direct rows); records
    the prefetch's own time as the background phase ``prefetch`` (0 without one)."""
    store = step.context.store
    if step.fetch is None:
        _, direct = store.no_fetch()
        step.clock.background("prefetch", Pending())  # no job: 0 seconds
    else:
        _, direct = step.fetch.wait()
        step.clock.background("prefetch", step.fetch)
    out = {f"slot_{n}": store.slots(n) for n in PROJECTIONS}
    return out | {f"direct_{n}": direct[n] for n in PROJECTIONS}


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        step: MoEStep,
        recorded: bool,
        x_SH: Tensor,
        weight_SK: Tensor,
        gate_up: Tensor,
        down: Tensor,
    ) -> Tensor:
        transport, plan, route, clock = step.context.transport, step.plan, step.route, step.clock
        t = time.perf_counter()
        recv = transport.dispatch(x_SH, route, plan, weight_SK=weight_SK.detach())
        t = clock.tick("dispatch", t)
        # needs_input_grad says which inputs require grad, whatever the grad mode; only a
        # step autograd records (grad mode on at apply) builds the experts' graph
        training = recorded and any(ctx.needs_input_grad[2:])
        rank = step.context.rank
        with torch.enable_grad():
            x_PH = (
                recv.tensor.detach().clone().requires_grad_(training) if training else recv.tensor
            )
            home = {
                "gate_up": gate_up.detach().requires_grad_(training),
                "down": down.detach().requires_grad_(training),
            }
            own = [(0, home["gate_up"], home["down"])]  # the home section
            y_PH = run_sections(x_PH, plan, rank, step.row_offset, own)
            t = clock.tick("experts", t)
            t = _wait_prefetch(step, t)
            remote = _remote_weights(step)
            # Slot rows are not copied: prefetch rewrites them only in this layer's next
            # forward, after this step's backward (see docs/training.md).
            rem = {n: _alias(w).requires_grad_(training) for n, w in remote.items()}
            others = _remote_sections(step, rem)  # the slots and the direct rows
            run_sections(x_PH, plan, rank, step.row_offset, others, out=y_PH)
        t = clock.tick("experts", t)
        y_SH = transport.combine(y_PH.detach(), route, weight_SK, recv.state)
        clock.tick("combine", t)
        step.traffic = recv.state.traffic
        ctx.step, ctx.state = step, recv.state
        ctx.graph = (x_PH, home, rem, y_PH) if training else None
        ctx.save_for_backward(weight_SK)
        return y_SH

    @staticmethod
    def backward(ctx: Any, dy_SH: torch.Tensor) -> tuple:
        step: MoEStep = ctx.step
        plan, route, clock = step.plan, step.route, step.clock
        (weight_SK,) = ctx.saved_tensors
        x_PH, home, rem, y_PH = ctx.graph
        clock.hooks.begin()  # the backward's phases start a new sequence
        t = time.perf_counter()
        transport = step.context.transport
        g_PH, dweight_SK = transport.combine_backward(dy_SH, route, plan, weight_SK, ctx.state)
        t = clock.tick("combine_backward", t)
        names = [f"{kind}_{n}" for kind in ("slot", "direct") for n in PROJECTIONS]
        leaves = [x_PH, home["gate_up"], home["down"], *(rem[n] for n in names)]
        raw: list[torch.Tensor | None] = [None] * len(leaves)
        if y_PH.requires_grad:  # false when this rank executes no rows at all
            raw = list(torch.autograd.grad(y_PH, leaves, g_PH, allow_unused=True))
        grads = [torch.zeros_like(v) if g is None else g for g, v in zip(raw, leaves, strict=True)]
        dx_PH, dgu_home, ddown_home, dgu_slot, ddown_slot, dgu_direct, ddown_direct = grads
        dgu_rem = torch.cat([dgu_slot, dgu_direct], 0)  # slots, then direct rows
        ddown_rem = torch.cat([ddown_slot, ddown_direct], 0)
        t = clock.tick("experts_backward", t)
        remote = {"gate_up": dgu_rem, "down": ddown_rem}
        dx_SH, reduced, t = _dispatch_backward_and_reduce(
            step, ctx.state, dx_PH, remote, dgu_home.shape[0]
        )
        dgu = (dgu_home.float() + reduced["gate_up"]).to(dgu_home.dtype)
        ddown = (ddown_home.float() + reduced["down"]).to(ddown_home.dtype)
        clock.tick("grad_reduce_exposed", t)
        ctx.graph = ctx.state = None
        return None, None, dx_SH, dweight_SK, dgu, ddown


def _dispatch_backward_and_reduce(
    step: MoEStep,
    state: StepState,
    dx_PH: torch.Tensor,
    remote: dict[str, torch.Tensor],
    num_home: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
    """Input gradients ``dx [P, H]`` back to token order and replica gradients home
    (collective).

    With an ``"inline"`` lane (the serial schedule, or an all-to-all transport on CUDA):
    dispatch-backward, then reduce. With a background lane (a one-sided transport, or an
    all-to-all transport whose worker has a process group of its own,
    ``EPGroup.background_group``): stage the replica gradients; the dispatch-backward's
    ``publish`` makes its rows and the staged gradients visible at once (on the
    all-to-all transport there is nothing to publish and the hook runs at the same
    point), the reduce starts there in the background (peer reads, or the all-to-all
    transport's collectives on the worker's group) while the rows move back, and a final
    ``publish`` keeps every reduce buffer until its readers are done. Same operations
    in the same order on the data either way: bit-identical results.

    Returns ``dx [S, H]`` in x's dtype, the fp32 home gradients ``[E_r, ...]`` per
    projection, and when the exposed part of the reduce began (perf_counter).
    """
    plan, route, clock = step.plan, step.route, step.clock
    transport, reducer, lane = step.context.transport, step.context.reducer, step.context.lane
    t = time.perf_counter()
    if lane.kind == "inline":
        dx_SH = transport.dispatch_backward(dx_PH, route, state)
        t = clock.tick("dispatch_backward", t)
        pending = lane.submit(lambda: reducer.reduce(plan, remote, num_home))
    else:
        reducer.stage(remote)
        started: list[Pending] = []

        def start_reduce() -> None:  # every rank's dx rows and staged gradients are visible
            started.append(lane.submit(lambda: reducer.collect(plan, num_home)))

        dx_SH = transport.dispatch_backward(dx_PH, route, state, after_publish=start_reduce)
        t = clock.tick("dispatch_backward", t)
        (pending,) = started  # the transport called start_reduce exactly once
    reduced = pending.wait()
    if lane.kind != "inline":
        transport.publish()  # nobody overwrites a reduce buffer still being read
    clock.background("grad_reduce", pending)
    return dx_SH, reduced, t


def moe_apply(
    step: MoEStep,
    x_SH: torch.Tensor,
    weight_SK: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """``y [S, H]`` of one MoE step (differentiable in ``x``, ``weight``, ``gate_up``, ``down``).

    Under ``no_grad`` (grad mode off) the step keeps no graph: the experts read the
    receive rows in place and nothing is saved for a backward.
    """
    recorded = torch.is_grad_enabled()
    return _MoEFunction.apply(step, recorded, x_SH, weight_SK, gate_up, down)
