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

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from moonplan.comm.group import EPGroup
from moonplan.core.experts import MoonExperts
from moonplan.core.routed import routed_forward
from moonplan.core.sharded import (
    RuntimeViews,
    agreed_construction,
    home_rows,
    options_config,
    resolve_group,
)
from moonplan.profiling.session import profiling
from moonplan.runtime.config import MoEConfig
from moonplan.runtime.contract import FixedPlacement
from moonplan.runtime.routers import (
    RouteFn,
    SigmoidGroupedConfig,
    sigmoid_grouped_topk,
    softmax_topk,
)


class MoonMoE(RuntimeViews, FixedPlacement):
    """Exactly balanced expert-parallel MoE layer (SwiGLU experts): a router, a
    :class:`~moonplan.adapters.MoonExperts` (which owns the runtime) and optional shared
    experts.

    Args:
        hidden_size: ``H``.
        ffn_size: ``F`` of each expert.
        num_experts: ``E``.
        top_k: ``K``. The four sizes may come from ``config`` instead.
        group: an :class:`~moonplan.comm.group.EPGroup` or a torch ProcessGroup
            (default: the default group if torch.distributed is initialised, else one rank).
        router: ``"softmax"`` (Mixtral), ``"sigmoid"`` (DeepSeek-V3) or a callable
            ``x [S, H] -> (topk_ids [S, K], topk_weight [S, K])``.
        shared_experts: optional module applied to every token and added.
        sigmoid_config: DeepSeek-V3 router settings for ``router="sigmoid"``.
        config: a :class:`~moonplan.runtime.config.MoEConfig` (default: every default).
        **options: options of :class:`~moonplan.runtime.config.MoEConfig` (``slots``,
            ``align``, ``max_tokens``, ``transport``, ``dtype``, ``balance``, ``overlap``,
            ``cost``; each with its default and meaning in the table of ``docs/api.md``,
            generated from ``moonplan.runtime.config.sections``), replacing the config's.
            Replicas beyond ``B`` slots read their weights from the home rank when they
            run (direct reads); ``cost`` left ``None`` is measured by the layer itself (a
            few exact warm-up steps, then :meth:`calibrate`, agreed across ranks).

    Attributes:
        router: ``nn.Linear(H, E)`` (the ``"softmax"``/``"sigmoid"`` routers' weights).
        experts: the :class:`~moonplan.adapters.MoonExperts`; ``gate_up [E_r, 2F, H]`` and
            ``down [E_r, H, F]`` are its parameters (state-dict keys
            ``experts.gate_up_proj``, ``experts.down_proj``).
        config: the :class:`MoEConfig` (sizes and dtype set). slots: ``B``.
        home_experts, home_range, group, runtime: the experts'.
    """

    def __init__(
        self,
        hidden_size: int | None = None,
        ffn_size: int | None = None,
        num_experts: int | None = None,
        top_k: int | None = None,
        *,
        group: EPGroup | object | None = None,
        router: str | Callable = "softmax",
        shared_experts: nn.Module | None = None,
        sigmoid_config: SigmoidGroupedConfig | None = None,
        config: MoEConfig | None = None,
        **options: Any,
    ):
        super().__init__()
        ep = resolve_group(group, None)
        with agreed_construction(ep, type(self).__name__):  # one rank's failure: everywhere
            sizes = dict(hidden_size=hidden_size, ffn_size=ffn_size, num_experts=num_experts)
            cfg = options_config(config, options, top_k=top_k, **sizes)
            H, _, E, _ = cfg.require_sizes()
            cfg = cfg.sized(dtype=cfg.layer_dtype())
            self.router = nn.Linear(H, E, bias=False, device=ep.device, dtype=cfg.sizes.dtype)
            self.route_fn = self._make_router(router, sigmoid_config, cfg, ep.device)
        self.experts = MoonExperts(group=ep, config=cfg, owner=type(self).__name__)
        self.register_buffer(
            "home_experts", self.experts.get_buffer("home_experts"), persistent=False
        )
        self.shared_experts = shared_experts
        self.runtime, self.group = self.experts.runtime, ep
        self.hidden_size, self.ffn_size, self.num_experts, self.top_k = cfg.require_sizes()
        self.slots, self.align, self.home_range = (
            self.experts.slots,
            cfg.buffers.align,
            self.experts.home_range,
        )
        self._register_load_state_dict_pre_hook(_renamed_expert_keys)

    config = property(
        attrgetter("experts.config"), doc="The :class:`MoEConfig` (sizes and dtype set)."
    )

    def rehome(
        self,
        order: Sequence[int] | str,
        *,
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
    ) -> int:
        """Collective, between steps: own the experts of home ``order`` from now on; the
        experts that changed rank (:meth:`ShardedExperts.rehome
        <moonplan.core.sharded.ShardedExperts.rehome>`, the router and shared experts stay)."""
        return self.experts.rehome(order, optimizers=optimizers)

    # The experts' parameters, under the names MoonMoE has always shown.
    gate_up = property(
        attrgetter("experts.gate_up_proj"), doc="``[E_r, 2F, H]`` home gate/up rows."
    )
    down = property(attrgetter("experts.down_proj"), doc="``[E_r, H, F]`` home down projections.")

    def _make_router(
        self,
        router: str | Callable,
        sigmoid: SigmoidGroupedConfig | None,
        cfg: MoEConfig,
        dev: torch.device,
    ) -> RouteFn:
        _, _, E, K = cfg.require_sizes()
        if callable(router):
            return router
        if router == "softmax":
            return lambda x: softmax_topk(self.router(x), K)
        if router == "sigmoid":
            bias_E = torch.zeros(E, device=dev)
            self.register_buffer("e_score_correction_bias", bias_E)
            conf = sigmoid or SigmoidGroupedConfig()
            return lambda x: sigmoid_grouped_topk(self.router(x), K, bias_E, conf)
        raise ValueError(f"router must be 'softmax', 'sigmoid' or a callable, got {router!r}")

    @torch.no_grad()
    def load_dense(
        self, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
    ) -> None:
        """Load every expert (``[E, H]``, ``[E, 2F, H]``, ``[E, H, F]``, rows by model id);
        keep this rank's (the rows of ``home_experts``, whatever the home order)."""
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
        order = self.experts.home_order
        self.gate_up.copy_(home_rows(gate_up, lo, hi, order))
        self.down.copy_(home_rows(down, lo, hi, order))
        self.weights_changed()

    def profile(self, *, aligned: bool = False) -> Any:
        """Profile this layer's phases: ``with layer.profile() as prof: ...``, then ``prof.report``.

        Every rank must enter and leave the block together (see ``moonplan.profile``).
        """
        return profiling(self, aligned=aligned)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` or ``[B, T, H]`` (any ``T``, also 0) -> same shape.

        Every rank of the group must call it (a rank with no tokens too). A bad input
        or router output on any rank raises the same ``ContractError`` on every rank.
        """
        return routed_forward(x, self.route_fn, self.experts, self.shared_experts, dims=(2, 3))


_OLD_EXPERT_KEYS = {"gate_up": "experts.gate_up_proj", "down": "experts.down_proj"}


def _renamed_expert_keys(state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load state dicts saved before ``MoonMoE`` held a ``MoonExperts``: their expert
    parameters were ``gate_up``/``down``, now ``experts.gate_up_proj``/``experts.down_proj``."""
    for old, new in _OLD_EXPERT_KEYS.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)
