"""``MoonExperts``: a drop-in for a transformers experts module whose experts run through moonplan.

Legend:
    R ranks, E experts, E_r this rank's home experts, H hidden, F expert FFN size,
    S tokens on this rank, K top-k

A transformers (>= 5) MoE block calls its experts as
``experts(hidden_states [S, H], top_k_index [S, K], top_k_weights [S, K]) -> [S, H]``
(the route-weighted sum of each token's SwiGLU experts). :class:`MoonExperts` has the
same call and the same parameter names, ``gate_up_proj [E_r, 2F, H]`` (gate rows first)
and ``down_proj [E_r, H, F]``, but holds only this rank's home experts and runs every
record through the exactly balanced runtime (plan, prefetch, dispatch, grouped SwiGLU,
combine). Every rank of the group must call it in every step, also with ``S = 0``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moonplan.comm.group import EPGroup
from moonplan.core.sharded import (
    ShardedExperts,
    agreed_construction,
    home_parameter,
    options_config,
    resolve_group,
)
from moonplan.runtime.config import MoEConfig
from moonplan.runtime.contract import FixedPlacement, check_tokens


class MoonExperts(FixedPlacement, ShardedExperts):
    """This rank's home experts of one MoE layer, run exactly balanced over the EP group.

    ``expert_tensors``: the names of its sharded parameters (what checkpoints shard).

    Args:
        gate_up_proj: every expert's ``[E, 2F, H]`` (gate rows, then up rows); this rank
            keeps a copy of its home rows ``[E_r, 2F, H]`` (those of the model ids
            ``home_experts``: ``config.home_order[lo:hi]`` under a home order), so the full
            tensor can be freed.
            The copy requires grad unless ``gate_up_proj`` is a frozen Parameter.
            ``None`` (with ``down_proj=None``): fresh home experts of the config's sizes
            (normal init, std ``H**-0.5`` and ``F**-0.5``), as :class:`~moonplan.MoonMoE`
            builds them.
        down_proj: every expert's ``[E, H, F]``.
        top_k: ``K`` (default: ``config.top_k``).
        group: an :class:`EPGroup` or a torch ProcessGroup (default: the default group
            if torch.distributed is initialised, else one rank on the weights' device).
        config: a :class:`~moonplan.runtime.config.MoEConfig` (sizes left ``None`` are read
            from the weights; a set one must match them).
        **options: fields of :class:`~moonplan.runtime.config.MoEConfig` (``slots``,
            ``align``, ``max_tokens``, ``transport``, ``balance``, ``overlap``, ``cost``,
            ``choose``, ...), replacing the config's.
        owner: the layer's name in the error of a config mismatch across ranks
            (:class:`~moonplan.MoonMoE` passes its own).

    Attributes:
        gate_up_proj, down_proj: Parameters ``[E_r, 2F, H]`` and ``[E_r, H, F]``, the
            weights' dtype, on the group's device.
        home_experts: int64 ``[E_r]`` model ids of the home experts, in the rows' order
            (non-persistent buffer).
        home_range: ``(lo, hi)``: the home experts' labels are ``lo .. hi-1`` (their model
            ids too without a home order: :mod:`moonplan.core.sharded`).
        num_experts, hidden_dim, intermediate_dim, top_k: ``E``, ``H``, ``F``, ``K``.
        config: the :class:`MoEConfig` (sizes set). slots: ``B``.
        runtime: the layer's :class:`~moonplan.runtime.layer_runtime.LayerRuntime`
            (``last_plan``, ``last_stats``).
    """

    expert_tensors = ("gate_up_proj", "down_proj")

    def __init__(
        self,
        gate_up_proj: torch.Tensor | None = None,
        down_proj: torch.Tensor | None = None,
        top_k: int | None = None,
        *,
        group: EPGroup | object | None = None,
        config: MoEConfig | None = None,
        owner: str = "MoonExperts",
        **options: Any,
    ):
        super().__init__()
        weights = gate_up_proj.device if isinstance(gate_up_proj, torch.Tensor) else None
        ep = resolve_group(group, weights)
        with agreed_construction(ep, owner):  # a failure on one rank raises on every rank
            cfg = options_config(config, options, top_k=top_k)
            if gate_up_proj is None and down_proj is None:
                self._fresh(ep, cfg)
            elif gate_up_proj is None or down_proj is None:
                raise ValueError("give both gate_up_proj and down_proj, or neither (fresh experts)")
            else:
                E, F, H = _expert_sizes(gate_up_proj, down_proj)
                sizes = dict(num_experts=E, hidden_size=H, ffn_size=F, dtype=gate_up_proj.dtype)
                lo, hi = self.setup(ep, cfg.sized(**sizes), gate_up_proj.device)
                self.gate_up_proj = home_parameter(gate_up_proj, lo, hi, self.home_order)
                self.down_proj = home_parameter(down_proj, lo, hi, self.home_order)
            self.hidden_dim, self.intermediate_dim, _, _ = self.config.require_sizes()
        self.start(owner)

    def _fresh(self, group: EPGroup, cfg: MoEConfig) -> None:
        """Freshly initialised home experts of ``cfg``'s sizes, on the group's device."""
        H, F, _, _ = cfg.require_sizes()
        cfg = cfg.sized(dtype=cfg.layer_dtype())
        lo, hi = self.setup(group, cfg, None)
        dev, dtype = self.group.device, cfg.sizes.dtype
        self.gate_up_proj = nn.Parameter(torch.empty(hi - lo, 2 * F, H, device=dev, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(hi - lo, H, F, device=dev, dtype=dtype))
        nn.init.normal_(self.gate_up_proj, std=H**-0.5)
        nn.init.normal_(self.down_proj, std=F**-0.5)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, {self.home_text()}, hidden={self.hidden_dim}, "
            f"ffn={self.intermediate_dim}, top_k={self.top_k}, ranks={self.group.size}"
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """``hidden_states [S, H]``, ``top_k_index [S, K]`` (int), ``top_k_weights [S, K]``
        -> ``[S, H]`` in ``hidden_states``' dtype: ``sum_k w[s,k] * SwiGLU_{id[s,k]}(x[s])``.

        Collective: every rank calls it. A bad input on any rank raises the same
        ``ContractError`` on every rank.
        """
        H, rt = self.hidden_dim, self.runtime
        msg = check_tokens(hidden_states, H, rt.dtype, self.group.device, dims=None)
        ok = not msg
        x_SH = hidden_states.reshape(-1, H) if ok else torch.zeros(0, H, dtype=rt.dtype)
        y_SH = self.run(x_SH.to(self.group.device), top_k_index, top_k_weights, ok, msg)
        return y_SH.view(hidden_states.shape) if ok else y_SH

    def run(
        self,
        x_SH: torch.Tensor,
        ids_SK: torch.Tensor | None,
        weight_SK: torch.Tensor,
        ok: bool = True,
        msg: str = "",
    ) -> torch.Tensor:
        """One collective step on ``x [S, H]`` with routing ``ids [S, K]``, ``weight [S, K]``.

        ``ok=False`` (with ``msg``) reports a failure seen before the step (e.g. the router
        raised): every rank then raises ``ContractError`` naming this rank and ``msg``.
        """
        self.step_begins()
        params: dict[str, torch.Tensor] = {"gate_up": self.gate_up_proj, "down": self.down_proj}
        return self.runtime.forward(x_SH, ids_SK, weight_SK, params, ok, msg)


def _expert_sizes(gate_up_EFH: torch.Tensor, down_EHF: torch.Tensor) -> tuple[int, int, int]:
    """``(E, F, H)`` of ``gate_up [E, 2F, H]`` and ``down [E, H, F]``; ValueError if they differ."""
    gu, dn = tuple(gate_up_EFH.shape), tuple(down_EHF.shape)
    if len(gu) != 3 or len(dn) != 3 or gu[1] % 2:
        raise ValueError(f"expected gate_up [E, 2F, H] and down [E, H, F], got {gu} and {dn}")
    E, F, H = gu[0], gu[1] // 2, gu[2]
    if dn != (E, H, F):
        raise ValueError(f"gate_up {gu} implies down (E, H, F) = {(E, H, F)}, got {dn}")
    if E < 1 or F < 1 or H < 1:
        raise ValueError(f"expert sizes must be positive, got gate_up {gu}")
    if gate_up_EFH.dtype != down_EHF.dtype:
        raise ValueError(f"gate_up is {gate_up_EFH.dtype} but down is {down_EHF.dtype}")
    return E, F, H
