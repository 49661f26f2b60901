"""``wrap_experts``: moonplan experts for a hand-written MoE layer (any router function).

Legend: R ranks, E experts, E_r this rank's home experts, H hidden, F expert FFN size,
S tokens on this rank, K top-k.

For layers that do not have transformers' block structure: give the router function,
every expert's SwiGLU weights and ``K``; get a module computing
``y = sum_k w[s,k] * SwiGLU_{id[s,k]}(x[s]) (+ shared_experts(x))`` over the EP group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moonplan.comm.group import EPGroup
from moonplan.core.experts import MoonExperts
from moonplan.core.routed import RoutedExperts, RouterFn
from moonplan.runtime.config import MoEConfig


def wrap_experts(
    router_fn: RouterFn,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    top_k: int | None = None,
    shared_experts: nn.Module | None = None,
    group: EPGroup | object | None = None,
    config: MoEConfig | None = None,
    **options: Any,
) -> RoutedExperts:
    """Experts of a hand-written MoE layer, run exactly balanced (collective constructor).

    Args:
        router_fn: ``x [S, H] -> (topk_ids [S, K] int, topk_weight [S, K] float)``; an
            ``nn.Module`` router becomes a child (its parameters get local gradients).
        gate_up: every expert's ``[E, 2F, H]`` (gate rows first), identical on every rank;
            this rank keeps a copy of its home slice.
        down: every expert's ``[E, H, F]``.
        top_k: ``K`` (default: ``router_fn.top_k``).
        shared_experts: optional module applied to every token and added.
        group, config, **options: as for :func:`moonplan.adapters.wrap`.

    Returns:
        :class:`RoutedExperts`; ``forward(x [..., H]) -> [..., H]``.
    """
    K = top_k if top_k is not None else getattr(router_fn, "top_k", None)
    if not isinstance(K, int) and (config is None or config.sizes.top_k is None):
        raise ValueError("wrap_experts needs top_k= (the router has no integer `top_k`)")
    experts = MoonExperts(gate_up, down, K, group=group, config=config, **options)
    return RoutedExperts(router_fn, experts, shared_experts)
