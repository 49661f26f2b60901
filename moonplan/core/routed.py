"""A router in front of :class:`~moonplan.core.experts.MoonExperts`: ``RoutedExperts`` and
the one forward it shares with :class:`~moonplan.core.moe.MoonMoE`.

Legend: R ranks, E experts, E_r this rank's home experts, H hidden, S tokens on this
rank, K top-k.

``y = sum_k w[s,k] * SwiGLU_{id[s,k]}(x[s]) (+ shared_experts(x))`` over the EP group,
with any router function ``x [S, H] -> (ids [S, K], weights [S, K])``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moonplan.core.experts import MoonExperts
from moonplan.runtime.contract import call_router, check_tokens

RouterFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class RoutedExperts(nn.Module):
    """A router, moonplan experts and optional shared experts (what :func:`wrap_experts` returns).

    Attributes:
        router: the router (a registered child if it is an ``nn.Module``, so its
            parameters train and are saved).
        experts: :class:`MoonExperts` (``gate_up_proj [E_r, 2F, H]``, ``down_proj [E_r, H, F]``).
        shared_experts: the module applied to every token, or ``None``.
    """

    def __init__(
        self, router: RouterFn, experts: MoonExperts, shared_experts: nn.Module | None = None
    ):
        super().__init__()
        if isinstance(router, nn.Module):
            self.router = router
        else:
            self._router_fn = router
        self.experts = experts
        self.shared_experts = shared_experts

    @property
    def route_fn(self) -> RouterFn:
        """The router as a callable ``x [S, H] -> (ids [S, K], weights [S, K])``."""
        router = self._modules.get("router")
        return router if router is not None else self._router_fn

    @property
    def home_experts(self) -> torch.Tensor:
        """int64 ``[E_r]``: global ids of this rank's home experts."""
        return self.experts.get_buffer("home_experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> same shape (collective: every rank calls it, also with no tokens).

        A router that raises, or returns bad ids/weights, on any rank makes every rank
        raise the same ``ContractError``.
        """
        return routed_forward(x, self.route_fn, self.experts, self.shared_experts, dims=None)


def routed_forward(
    x: torch.Tensor,
    route_fn: RouterFn,
    experts: MoonExperts,
    shared_experts: nn.Module | None,
    *,
    dims: tuple[int, ...] | None,
) -> torch.Tensor:
    """``y = experts(x, *route_fn(x)) (+ shared_experts(x))``, ``x [..., H]`` -> same shape.

    The one forward of a router in front of :class:`MoonExperts` (:class:`RoutedExperts`
    and :class:`~moonplan.MoonMoE`). Collective: a bad ``x`` (``dims``: the dims it may
    have, ``None`` any), a router that raises or bad routing on any rank makes every
    rank raise the same ``ContractError``.
    """
    H, dtype, dev = experts.hidden_dim, experts.runtime.dtype, experts.group.device
    msg = check_tokens(x, H, dtype, dev, dims=dims)
    if msg:
        bad = torch.zeros(0, H, dtype=dtype, device=dev)
        return experts.run(bad, None, bad, ok=False, msg=msg)
    x_SH = x.reshape(-1, H)
    ids_SK, weight_SK, msg = call_router(route_fn, x_SH)
    y_SH = experts.run(x_SH, ids_SK, weight_SK, not msg, msg)
    if shared_experts is not None:
        y_SH = y_SH + shared_experts(x_SH)
    return y_SH.view(x.shape)
