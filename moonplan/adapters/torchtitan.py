"""torchtitan's ``MoE`` with its routed experts run exactly balanced through moonplan.

Legend:
    R ranks, E experts, E_r this rank's home experts, D model dim (torchtitan's name for
    the hidden size), F expert FFN size, B batch, L sequence length, T = B*L tokens of
    this rank, K top-k

torchtitan (>= 0.3) builds an MoE layer as ``MoE(router, routed_experts, shared_experts)``
whose forward calls
``routed_experts(x [B, L, D], topk_scores [B, L, K], topk_expert_ids [B, L, K],
num_local_tokens_per_expert [E]) -> [B, L, D]``. Its ``RoutedExperts`` holds a token
dispatcher and ``inner_experts``, a ``GroupedExperts`` with ``w1_EFD [E, F, D]`` (gate),
``w3_EFD [E, F, D]`` (up) and ``w2_EDF [E, D, F]`` (down), computing
``w2 @ (silu(w1 @ x) * (w3 @ x))`` in bf16 whatever the parameters' dtype.

A token dispatcher alone cannot run moonplan: a dispatcher only moves tokens to the
experts a rank *owns*, while moonplan also executes replicas of hot experts on other
ranks. So :func:`wrap_moe` replaces the whole ``routed_experts`` child by a
:class:`MoonRoutedExperts` with the same call and the same parameter names
(``routed_experts.inner_experts.w1_EFD`` ...), holding only this rank's home experts.
``MoE.forward`` stays torchtitan's own: the router (softmax or sigmoid top-k,
node-limited groups, ``route_norm``, ``route_scale``), the expert-bias load balancing
(``expert_bias_E``, ``tokens_per_expert_E`` and torchtitan's optimizer hook that updates
the bias) and the shared experts are untouched.

Detection is by structure (no torchtitan import): :func:`is_torchtitan_moe`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moonplan.adapters.swap import with_experts
from moonplan.comm.group import EPGroup
from moonplan.core.sharded import (
    ShardedExperts,
    agreed_construction,
    home_parameter,
    options_config,
    resolve_group,
)
from moonplan.runtime.config import MoEConfig
from moonplan.runtime.outside_inference import outside_inference

WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")


class UnsupportedTorchtitanMoE(TypeError):
    """A module is not a torchtitan ``MoE`` of the structure moonplan runs; says why."""


def torchtitan_moe_problem(module: nn.Module) -> str | None:
    """Why ``module`` is not a torchtitan ``MoE`` moonplan can run (``None``: it is).

    Expected: children ``router`` (an integer ``top_k``) and ``routed_experts``, whose child
    ``inner_experts`` has exactly the parameters ``w1_EFD [E, F, D]``, ``w2_EDF [E, D, F]``,
    ``w3_EFD [E, F, D]`` (plain tensors of one dtype, not DTensors).
    """
    router = module._modules.get("router")
    routed = module._modules.get("routed_experts")
    if router is None or routed is None:
        return "children `router` and `routed_experts`"
    if isinstance(routed, MoonRoutedExperts):
        return "a MoE that is not wrapped yet (its routed experts already run on moonplan)"
    inner = routed._modules.get("inner_experts")
    if inner is None:
        return "`routed_experts.inner_experts` (torchtitan's GroupedExperts)"
    own = dict(inner.named_parameters())
    if sorted(own) != sorted(WEIGHTS):
        return f"inner_experts parameters exactly {', '.join(WEIGHTS)}; found {sorted(own)}"
    w1, w2, w3 = (own[n] for n in WEIGHTS)
    if type(w1.data) is not torch.Tensor:  # a DTensor: torchtitan's own EP/TP sharding
        return (
            "plain (unsharded) expert weights: wrap before torchtitan's parallelize() "
            f"shards them; found {type(w1.data).__name__}"
        )
    if w1.dim() != 3 or w1.shape != w3.shape or w2.shape != (w1.shape[0], w1.shape[2], w1.shape[1]):
        return (
            "w1_EFD [E, F, D], w3_EFD [E, F, D], w2_EDF [E, D, F]; found "
            f"{tuple(w1.shape)}, {tuple(w3.shape)}, {tuple(w2.shape)}"
        )
    if not (w1.dtype == w2.dtype == w3.dtype):
        return f"one dtype for w1, w2, w3; found {w1.dtype}, {w2.dtype}, {w3.dtype}"
    k = getattr(router, "top_k", None)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= w1.shape[0]:
        return f"an integer router.top_k in [1, {w1.shape[0]}]; found {k!r}"
    return None


def is_torchtitan_moe(module: nn.Module) -> bool:
    """Whether :func:`wrap_moe` accepts ``module`` (structure only; torchtitan not imported)."""
    return torchtitan_moe_problem(module) is None


class MoonGroupedExperts(ShardedExperts):
    """This rank's home experts in torchtitan's layout, run exactly balanced over the EP group.

    Args:
        w1_EFD, w2_EDF, w3_EFD: every expert's weights (``[E, F, D]``, ``[E, D, F]``,
            ``[E, F, D]``), identical on every rank; this rank keeps copies of its home rows
            (those of the model ids ``home_experts``: ``config.home_order[lo:hi]`` under a
            home order).
        top_k: ``K`` (default: ``config.top_k``).
        group: an :class:`EPGroup` or a torch ProcessGroup (default: the default group if
            torch.distributed is initialised, else one rank on the weights' device).
        compute_dtype: dtype of the expert GEMMs and of the rows and weights that move
            (default ``config.dtype``, else bf16, what torchtitan's ``GroupedExperts``
            computes in).
        config, **options: as for :class:`~moonplan.adapters.MoonExperts` (a
            :class:`~moonplan.runtime.config.MoEConfig` and keyword fields of it).

    Attributes:
        w1_EFD, w2_EDF, w3_EFD: Parameters ``[E_r, F, D]``, ``[E_r, D, F]``, ``[E_r, F, D]``
            in the original weights' dtype (torchtitan's names, so its optimizer, weight
            decay and checkpoint code see the same keys).
        home_experts: int64 ``[E_r]`` model ids, in the rows' order (non-persistent buffer).
        home_range: ``(lo, hi)``, labels (:mod:`moonplan.core.sharded`).
        num_experts: ``E`` (global, as torchtitan reads it).
        dim, hidden_dim: ``D`` and ``F``. compute_dtype: the runtime's dtype.
        runtime: the :class:`~moonplan.runtime.layer_runtime.LayerRuntime` (``last_plan``,
            ``last_stats``).
    """

    expert_tensors = WEIGHTS

    def __init__(
        self,
        w1_EFD: torch.Tensor,
        w2_EDF: torch.Tensor,
        w3_EFD: torch.Tensor,
        top_k: int | None = None,
        *,
        group: EPGroup | object | None = None,
        compute_dtype: torch.dtype | None = None,
        config: MoEConfig | None = None,
        **options: Any,
    ):
        super().__init__()
        ep = resolve_group(group, w1_EFD.device)
        with agreed_construction(ep, "MoonGroupedExperts"):  # one rank's failure: everywhere
            cfg = options_config(config, options, top_k=top_k, dtype=compute_dtype)
            E, F, D = w1_EFD.shape
            dtype = cfg.sizes.dtype or torch.bfloat16
            sizes = dict(num_experts=E, hidden_size=D, ffn_size=F, dtype=dtype)
            lo, hi = self.setup(ep, cfg.sized(**sizes), w1_EFD.device)
            self.dim, self.hidden_dim, self.compute_dtype = D, F, self.config.sizes.dtype
            order = self.home_order
            self.w1_EFD = home_parameter(w1_EFD, lo, hi, order)
            self.w2_EDF = home_parameter(w2_EDF, lo, hi, order)
            self.w3_EFD = home_parameter(w3_EFD, lo, hi, order)
        self.start("MoonGroupedExperts")

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, {self.home_text()}, dim={self.dim}, "
            f"hidden_dim={self.hidden_dim}, top_k={self.top_k}, ranks={self.group.size}, "
            f"compute_dtype={self.compute_dtype}"
        )

    @outside_inference()  # the cast copies below carry version counters (none in it)
    def run(
        self, x_TD: torch.Tensor, ids_TK: torch.Tensor, scores_TK: torch.Tensor
    ) -> torch.Tensor:
        """``[T, D]`` in ``x``'s dtype: ``sum_k scores[t,k] * expert_{ids[t,k]}(x[t])``.

        Collective: every rank calls it, also with ``T = 0``. Bad routing on any rank
        raises the same ``ContractError`` on every rank. Runs outside inference mode
        (:mod:`moonplan.runtime.outside_inference`): under ``torch.inference_mode()``
        the output is a normal tensor.
        """
        self.step_begins()  # auto's own re-home, before the cast copies below
        c = self.runtime.dtype
        params = {
            "gate_up": torch.cat([self.w1_EFD, self.w3_EFD], dim=1).to(c),  # [E_r, 2F, D]
            "down": self.w2_EDF.to(c),
            # the originals too: their version counters tell the runtime when an optimizer
            # step changed them (the cast copies above are new tensors every step)
            **{n: getattr(self, n) for n in WEIGHTS},
        }
        own = {n: params[n] for n in ("gate_up", "down")}  # the originals keep their dtype
        y = self.runtime.forward(x_TD.to(c), ids_TK, scores_TK, params, own=own)
        return y.to(x_TD.dtype)


class MoonRoutedExperts(nn.Module):
    """Drop-in for torchtitan's ``RoutedExperts``: the same call, experts on moonplan.

    Attributes:
        inner_experts: :class:`MoonGroupedExperts` (so parameter names stay
            ``routed_experts.inner_experts.w1_EFD`` ...).
    """

    def __init__(self, inner_experts: MoonGroupedExperts):
        super().__init__()
        self.inner_experts = inner_experts

    def forward(
        self,
        x_BLD: torch.Tensor,
        topk_scores_BLK: torch.Tensor,
        topk_expert_ids_BLK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [B, L, D]``, scores and ids ``[B, L, K]`` -> routed output ``[B, L, D]``.

        ``num_local_tokens_per_expert_E`` (torchtitan passes it) is not needed: the runtime
        counts the ids itself and all-gathers the counts with its status flag.
        """
        del num_local_tokens_per_expert_E
        D, K = x_BLD.shape[-1], topk_expert_ids_BLK.shape[-1]
        y_TD = self.inner_experts.run(
            x_BLD.reshape(-1, D), topk_expert_ids_BLK.reshape(-1, K), topk_scores_BLK.reshape(-1, K)
        )
        return y_TD.view(x_BLD.shape)

    def parallelize(self, parallel_dims: Any) -> None:
        """Refuse torchtitan's expert parallelism on top of moonplan's (loudly, not silently)."""
        raise RuntimeError(
            "this MoE's routed experts run on moonplan, which already shards them over its EP "
            "group: do not apply torchtitan's expert parallelism to it (set ep degree 1)"
        )


def wrap_moe(
    moe: nn.Module,
    *,
    group: EPGroup | object | None = None,
    compute_dtype: torch.dtype | None = None,
    config: MoEConfig | None = None,
    **options: Any,
) -> nn.Module:
    """One torchtitan ``MoE`` with its routed experts on moonplan (collective constructor).

    Args:
        moe: a torchtitan ``MoE`` (see :func:`torchtitan_moe_problem`), with its final
            weights (initialised or loaded), identical on every rank, on the group's device.
        group: an :class:`EPGroup` or a torch ProcessGroup (default: the default group).
        compute_dtype: the experts' GEMM dtype (default ``config.dtype``, else bf16, as
            torchtitan's).
        config, **options: as for :func:`moonplan.adapters.wrap` (``slots``, ``align``, ...).

    Returns:
        A shallow copy of ``moe`` (same class, same forward) sharing the router, the shared
        experts and the load-balancing buffers with ``moe``, whose ``routed_experts`` is a
        :class:`MoonRoutedExperts`. ``moe`` itself is left as it was.

    Raises:
        UnsupportedTorchtitanMoE: naming what was expected and found.
    """
    problem = torchtitan_moe_problem(moe)
    if problem is not None:
        raise UnsupportedTorchtitanMoE(
            f"cannot wrap {type(moe).__name__} as a torchtitan MoE: expected {problem}"
        )
    inner = moe.get_submodule("routed_experts.inner_experts")
    w1, w2, w3 = (inner.get_parameter(n) for n in WEIGHTS)
    experts = MoonGroupedExperts(
        w1,
        w2,
        w3,
        int(getattr(moe.get_submodule("router"), "top_k")),  # noqa: B009 (checked above)
        group=group,
        compute_dtype=compute_dtype,
        config=config,
        **options,
    )
    return with_experts(moe, "routed_experts", MoonRoutedExperts(experts), experts)
