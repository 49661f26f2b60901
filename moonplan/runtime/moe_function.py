"""The MoE step as an autograd function: backward replays the forward plan.

Legend:
    R ranks, S tokens, K top-k, N = S*K records, H hidden, P receive rows of this rank,
    M home rows, B slots, D direct rows, E_r home experts of this rank

Forward: dispatch token rows -> experts on the receive rows -> gather each
record's output -> ``y = sum_k w * o`` (fp32). Backward (same plan and route,
no re-planning, no counts exchange): ``dw = <dy, o>``; combine-backward is a
dispatch of the records' ``w * dy``; the experts' backward gives the receive
rows' input gradients and the weight gradients; dispatch-backward is a gather
of those rows summed over ``k``; replica-row weight gradients go to their home
rank (:class:`~moonplan.runtime.store.GradReducer`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from moonplan.plan.plan_type import Plan
from moonplan.plan.route import Route
from moonplan.runtime.experts_section import run_sections
from moonplan.runtime.store import PROJECTIONS
from moonplan.runtime.transport import weighted_sum


@dataclass
class MoEStep:
    """What forward and backward of one step share (the runtime, plan and route)."""

    runtime: Any  # LayerRuntime (kept untyped to avoid an import cycle)
    plan: Plan
    route: Route
    phases: dict[str, float] = field(default_factory=dict)

    def tick(self, name: str, t0: float) -> float:
        t = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + t - t0
        return t


def _sections(
    step: MoEStep, home: dict[str, torch.Tensor], remote: dict[str, torch.Tensor]
) -> list:
    rt = step.runtime
    M, B = rt.M, rt.B
    return [
        (0, home["gate_up"], home["down"]),
        (M, remote["gate_up"][:B], remote["down"][:B]),
        (M + B, remote["gate_up"][B:], remote["down"][B:]),
    ]


def _remote_weights(step: MoEStep) -> dict[str, torch.Tensor]:
    """Slot rows then direct rows (``[B + D, ...]``) of this rank's replicas."""
    store = step.runtime.store
    direct = store.direct(step.plan)
    return {n: torch.cat([store.slots(n), direct[n]], 0) for n in PROJECTIONS}


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        step: MoEStep,
        x_SH: torch.Tensor,
        weight_SK: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
    ) -> torch.Tensor:
        rt, plan, route = step.runtime, step.plan, step.route
        t = time.perf_counter()
        recv = rt.transport.dispatch(x_SH, route, plan)
        t = step.tick("dispatch", t)
        remote = _remote_weights(step)
        training = any(ctx.needs_input_grad[1:])
        with torch.enable_grad():
            x_PH = (
                recv.tensor.detach().clone().requires_grad_(training) if training else recv.tensor
            )
            home = {
                "gate_up": gate_up.detach().requires_grad_(training),
                "down": down.detach().requires_grad_(training),
            }
            rem = {n: w.detach().clone().requires_grad_(training) for n, w in remote.items()}
            y_PH = run_sections(x_PH, plan, rt.group.rank, _sections(step, home, rem))
        rt.transport.out_local()[: y_PH.shape[0]] = y_PH.detach()
        t = step.tick("experts", t)
        o_SKH = rt.transport.gather(route)
        y_SH = weighted_sum(o_SKH, weight_SK, x_SH.dtype)
        step.tick("combine", t)
        ctx.step, ctx.graph = step, (x_PH, home, rem, y_PH) if training else None
        ctx.save_for_backward(o_SKH, weight_SK)
        return y_SH

    @staticmethod
    def backward(ctx: Any, dy_SH: torch.Tensor) -> tuple:
        step: MoEStep = ctx.step
        rt, plan, route = step.runtime, step.plan, step.route
        o_SKH, weight_SK = ctx.saved_tensors
        x_PH, home, rem, y_PH = ctx.graph
        t = time.perf_counter()
        dy32_SH = dy_SH.float()
        dweight_SK = (dy32_SH[:, None, :] * o_SKH.float()).sum(-1).to(weight_SK.dtype)
        g_NH = (
            (weight_SK.float()[:, :, None] * dy32_SH[:, None, :])
            .to(o_SKH.dtype)
            .reshape(-1, o_SKH.shape[2])
        )
        g_PH = rt.transport.dispatch(g_NH, route, plan, per_token=False).tensor
        t = step.tick("combine_backward", t)
        leaves = [x_PH, home["gate_up"], home["down"], rem["gate_up"], rem["down"]]
        raw: list[torch.Tensor | None] = [None] * len(leaves)
        if y_PH.requires_grad:  # false when this rank executes no rows at all
            raw = list(torch.autograd.grad(y_PH, leaves, g_PH, allow_unused=True))
        grads = [torch.zeros_like(v) if g is None else g for g, v in zip(raw, leaves, strict=True)]
        dx_PH, dgu_home, ddown_home, dgu_rem, ddown_rem = grads
        t = step.tick("experts_backward", t)
        rt.transport.out_local()[: dx_PH.shape[0]] = dx_PH
        dx_SKH = rt.transport.gather(route)
        dx_SH = weighted_sum(dx_SKH, torch.ones_like(weight_SK), dy_SH.dtype)
        t = step.tick("dispatch_backward", t)
        reduced = rt.reducer().reduce(
            plan, {"gate_up": dgu_rem, "down": ddown_rem}, dgu_home.shape[0]
        )
        dgu = (dgu_home.float() + reduced["gate_up"]).to(dgu_home.dtype)
        ddown = (ddown_home.float() + reduced["down"]).to(ddown_home.dtype)
        step.tick("grad_reduce", t)
        ctx.graph = None
        return None, dx_SH, dweight_SK, dgu, ddown


def moe_apply(
    step: MoEStep,
    x_SH: torch.Tensor,
    weight_SK: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """``y [S, H]`` of one MoE step (differentiable in ``x``, ``weight``, ``gate_up``, ``down``)."""
    return _MoEFunction.apply(step, x_SH, weight_SK, gate_up, down)
