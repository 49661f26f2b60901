"""``MoonMoE``: a Mixture-of-Experts layer whose experts run exactly balanced over EP ranks.

Legend:
    R ranks, E experts, M = ceil(E/R), E_r this rank's home experts, B slots,
    H hidden, F expert FFN size, S tokens on this rank, K top-k

One forward: route locally, all-gather the counts (with a validity flag, so a
bad input raises the same error on every rank), plan (every rank computes the
same plan), prefetch new slots, dispatch records into the executing ranks'
expert-grouped receive rows, run the experts (grouped SwiGLU), combine back
with the route weights in fp32, add the shared experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moonplan.comm.group import EPGroup
from moonplan.plan.plan_type import Plan
from moonplan.runtime.balance import balance_mode
from moonplan.runtime.contract import (
    FixedPlacement,
    call_router,
    check_params,
    check_routing,
    check_tokens,
)
from moonplan.runtime.routers import (
    RouteFn,
    SigmoidGroupedConfig,
    sigmoid_grouped_topk,
    softmax_topk,
)
from moonplan.runtime.setup import StepStats, make_runtime, register_home
from moonplan.runtime.slot_budget import Bytes, resolve_slots
from moonplan.stepcost import StepCost


class MoonMoE(FixedPlacement):
    """Exactly balanced expert-parallel MoE layer (SwiGLU experts).

    Args:
        hidden_size: ``H``.
        ffn_size: ``F`` of each expert.
        num_experts: ``E``.
        top_k: ``K``.
        group: an :class:`~moonplan.comm.group.EPGroup` or a torch ProcessGroup
            (default: the default group if torch.distributed is initialised, else one rank).
        slots: weight slots per rank for replicas: an ``int`` count ``B``, a memory
            budget (``"2GiB"``-style string or :class:`~moonplan.runtime.slot_budget.Bytes`),
            or a ``float`` fraction of the home experts' bytes (default
            ``min(2, M)``; see ``moonplan.runtime.slot_budget``). Replicas beyond ``B``
            read their weights from the home rank when they run (direct reads).
        router: ``"softmax"`` (Mixtral), ``"sigmoid"`` (DeepSeek-V3) or a callable
            ``x [S, H] -> (topk_ids [S, K], topk_weight [S, K])``.
        align: receive-row padding multiple.
        shared_experts: optional module applied to every token and added.
        sigmoid_config: DeepSeek-V3 router settings for ``router="sigmoid"``.
        max_tokens: expected tokens per rank (sizes the receive buffers; they grow
            collectively when a step needs more).
        transport: ``"auto"`` (a symmetric heap where one spans the group, else
            all-to-all), ``"heap"`` or ``"a2a"``.
        dtype: parameter dtype (default ``torch.get_default_dtype()``).
        balance: ``"auto"`` (default: per step the plan with the least predicted step
            time, see ``moonplan.runtime.balance``), ``"exact"`` (always exactly
            balanced) or ``"off"`` (static EP: every record on its home rank, the
            baseline). ``True``/``False`` are deprecated aliases of ``"exact"``/``"off"``.
        overlap: run the weight prefetch beside the dispatch and the home experts, and
            the replica-gradient reduce beside the dispatch-backward (default); ``False``
            runs the same operations serially (bit-identical results).
        cost: the :class:`~moonplan.stepcost.StepCost` ``balance="auto"`` plans with;
            default: measured by the layer itself (a few exact warm-up steps, then
            :meth:`calibrate`, agreed across ranks).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        *,
        group: EPGroup | object | None = None,
        slots: int | float | str | Bytes | None = None,
        router: str | Callable = "softmax",
        align: int = 1,
        shared_experts: nn.Module | None = None,
        sigmoid_config: SigmoidGroupedConfig | None = None,
        max_tokens: int = 1024,
        transport: str = "auto",
        dtype: torch.dtype | None = None,
        balance: str | bool = "auto",
        overlap: bool = True,
        cost: StepCost | None = None,
    ):
        super().__init__()
        _check_sizes(hidden_size, ffn_size, num_experts, top_k)
        balance = balance_mode(balance)
        self.group = group if isinstance(group, EPGroup) else EPGroup(group)
        self.hidden_size, self.ffn_size = hidden_size, ffn_size
        self.num_experts, self.top_k, self.align = num_experts, top_k, align
        dtype = dtype or torch.get_default_dtype()
        self.slots = resolve_slots(
            slots,
            num_experts=num_experts,
            ranks=self.group.size,
            hidden=hidden_size,
            ffn=ffn_size,
            dtype=dtype,
        )
        dev = self.group.device
        self.home_range = lo, hi = register_home(self, self.group, num_experts)
        self.router = nn.Linear(hidden_size, num_experts, bias=False, device=dev, dtype=dtype)
        self.gate_up = nn.Parameter(
            torch.empty(hi - lo, 2 * ffn_size, hidden_size, device=dev, dtype=dtype)
        )
        self.down = nn.Parameter(
            torch.empty(hi - lo, hidden_size, ffn_size, device=dev, dtype=dtype)
        )
        nn.init.normal_(self.gate_up, std=hidden_size**-0.5)
        nn.init.normal_(self.down, std=ffn_size**-0.5)
        self.shared_experts = shared_experts
        self.route_fn = self._make_router(router, sigmoid_config, dev)
        self.runtime = make_runtime(
            self.group,
            num_experts=num_experts,
            slots=self.slots,
            hidden=hidden_size,
            ffn=ffn_size,
            top_k=top_k,
            align=align,
            dtype=dtype,
            max_tokens=max_tokens,
            transport=transport,
            balance=balance,
            what="MoonMoE",
            cost=cost,
        )
        self.runtime.overlap = overlap

    def _make_router(
        self, router: str | Callable, cfg: SigmoidGroupedConfig | None, dev: torch.device
    ) -> RouteFn:
        K = self.top_k
        if callable(router):
            return router
        if router == "softmax":
            return lambda x: softmax_topk(self.router(x), K)
        if router == "sigmoid":
            bias_E = torch.zeros(self.num_experts, device=dev)
            self.register_buffer("e_score_correction_bias", bias_E)
            conf = cfg or SigmoidGroupedConfig()
            return lambda x: sigmoid_grouped_topk(self.router(x), K, bias_E, conf)
        raise ValueError(f"router must be 'softmax', 'sigmoid' or a callable, got {router!r}")

    @torch.no_grad()
    def load_dense(
        self, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
    ) -> None:
        """Load every expert (``[E, H]``, ``[E, 2F, H]``, ``[E, H, F]``); keep this rank's."""
        E, H, F = self.num_experts, self.hidden_size, self.ffn_size
        for name, t, shape in (
            ("router_weight", router_weight, (E, H)),
            ("gate_up", gate_up, (E, 2 * F, H)),
            ("down", down, (E, H, F)),
        ):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        self.router.weight.copy_(router_weight)
        lo, hi = self.home_range
        self.gate_up.copy_(gate_up[lo:hi])
        self.down.copy_(down[lo:hi])
        self.weights_changed()

    def weights_changed(self) -> None:
        """Mark every slot stale (in-place parameter updates are detected without it)."""
        self.runtime.weights_changed()

    def profile(self, *, aligned: bool = False) -> Any:
        """Profile this layer's phases: ``with layer.profile() as prof: ...``, then ``prof.report``.

        Every rank must enter and leave the block together (see ``moonplan.profile``).
        """
        from moonplan.profiling.session import profiling

        return profiling(self, aligned=aligned)

    def calibrate(self) -> StepCost:
        """Collective: build the layer's :class:`~moonplan.stepcost.StepCost` from its
        measured steps (every rank, same point), agreed across ranks; ``"auto"`` uses it
        from the next step. Runs by itself after the warm-up steps when no ``cost`` was given.
        """
        return self.runtime.calibrate()

    @property
    def cost(self) -> StepCost | None:
        """The cost model ``balance="auto"`` plans with (``None`` until calibrated)."""
        return self.runtime.balancer.cost

    @property
    def last_plan(self) -> Plan | None:
        """The plan of the last forward (``None`` before the first)."""
        return self.runtime.last_plan

    @property
    def last_stats(self) -> StepStats | None:
        """Figures of the last forward (copies, prefetched rows, phase times)."""
        return self.runtime.last_stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` or ``[B, T, H]`` (any ``T``, also 0) -> same shape.

        Every rank of the group must call it (a rank with no tokens too). A bad input
        or router output on any rank raises the same ``ContractError`` on every rank.
        """
        x_SH, ids_SK, weight_SK, ok, msg = self._contribution(x)
        params: dict[str, torch.Tensor] = {"gate_up": self.gate_up, "down": self.down}
        y_SH = self.runtime.forward(x_SH, ids_SK if ok else None, weight_SK, params, ok, msg)
        if self.shared_experts is not None:
            y_SH = y_SH + self.shared_experts(x_SH)
        return y_SH.view(x.shape)

    def _contribution(self, x: torch.Tensor) -> tuple[torch.Tensor, Any, Any, bool, str]:
        """``(x [S, H], ids [S, K], weight [S, K], ok, why)`` this rank brings to the step
        (see ``moonplan.runtime.contract``); placeholders where it is not ``ok``."""
        H, K, rt, dev = self.hidden_size, self.top_k, self.runtime, self.group.device
        params = {"gate_up": self.gate_up, "down": self.down}
        msg = check_params(params, rt.dtype, dev) or check_tokens(x, H, rt.dtype, dev)
        if not msg:
            x_SH = x.reshape(-1, H)
            ids_SK, weight_SK, msg = call_router(self.route_fn, x_SH)
            msg = msg or check_routing(ids_SK, weight_SK, x_SH.shape[0], self.num_experts, K, dev)
        if msg:
            empty_SH = torch.zeros(0, H, dtype=rt.dtype, device=dev)
            return empty_SH, None, torch.zeros(0, K, device=dev), False, msg
        return x_SH, ids_SK.long(), weight_SK, True, ""


def _check_sizes(H: int, F: int, E: int, K: int) -> None:
    for name, v, low in (
        ("hidden_size", H, 1),
        ("ffn_size", F, 1),
        ("num_experts", E, 1),
        ("top_k", K, 1),
    ):
        if not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    if K > E:
        raise ValueError(f"top_k ({K}) cannot exceed num_experts ({E})")
