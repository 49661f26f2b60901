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

import torch
import torch.distributed as dist
from torch import nn

from moonplan.comm.group import EPGroup
from moonplan.runtime.balance import balance_mode
from moonplan.runtime.contract import FixedPlacement, check_params, check_routing, check_tokens
from moonplan.runtime.setup import make_runtime, register_home
from moonplan.runtime.slot_budget import Bytes, resolve_slots
from moonplan.stepcost import StepCost


class MoonExperts(FixedPlacement):
    """This rank's home experts of one MoE layer, run exactly balanced over the EP group.

    ``expert_tensors``: the names of its sharded parameters (what checkpoints shard).

    Args:
        gate_up_proj: every expert's ``[E, 2F, H]`` (gate rows, then up rows); this rank
            keeps a copy of its home slice ``[E_r, 2F, H]``, so the full tensor can be freed.
            The copy requires grad unless ``gate_up_proj`` is a frozen Parameter.
        down_proj: every expert's ``[E, H, F]``.
        top_k: ``K``.
        group: an :class:`EPGroup` or a torch ProcessGroup (default: the default group
            if torch.distributed is initialised, else one rank on the weights' device).
        slots: weight slots per rank: a count, a byte budget (``"2GiB"``, ``Bytes``) or a
            fraction of the home experts' bytes (default ``min(2, ceil(E/R))``; see
            :class:`~moonplan.MoonMoE`).
        align: receive-row padding multiple.
        max_tokens: expected tokens per rank (receive buffers grow when a step needs more).
        transport: ``"auto"``, ``"heap"`` or ``"a2a"`` (see :class:`~moonplan.MoonMoE`).
        balance: ``"auto"`` (default), ``"exact"`` or ``"off"`` (static EP, the
            baseline); see :class:`~moonplan.MoonMoE` (bools are deprecated aliases).
        cost: the ``StepCost`` of ``balance="auto"`` (default: calibrated by the layer).

    Attributes:
        gate_up_proj, down_proj: Parameters ``[E_r, 2F, H]`` and ``[E_r, H, F]``, the
            weights' dtype, on the group's device.
        home_experts: int64 ``[E_r]`` global ids of the home experts (non-persistent buffer).
        home_range: ``(lo, hi)``: the home experts are ``lo .. hi-1``.
        num_experts, hidden_dim, intermediate_dim, top_k: ``E``, ``H``, ``F``, ``K``.
        runtime: the layer's :class:`~moonplan.runtime.setup.LayerRuntime` (``last_plan``,
            ``last_stats``).
    """

    expert_tensors = ("gate_up_proj", "down_proj")

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        top_k: int,
        *,
        group: EPGroup | object | None = None,
        slots: int | float | str | Bytes | None = None,
        align: int = 1,
        max_tokens: int = 1024,
        transport: str = "auto",
        balance: str | bool = "auto",
        cost: StepCost | None = None,
    ):
        super().__init__()
        balance = balance_mode(balance)
        E, F, H = _expert_sizes(gate_up_proj, down_proj)
        if not isinstance(top_k, int) or not 1 <= top_k <= E:
            raise ValueError(f"top_k must be an integer in [1, {E}], got {top_k!r}")
        self.group = _group(group, gate_up_proj.device)
        self.num_experts, self.hidden_dim, self.intermediate_dim, self.top_k = E, H, F, top_k
        dev = self.group.device
        if gate_up_proj.device != dev:
            raise ValueError(
                f"expert weights are on {gate_up_proj.device} but the EP group communicates "
                f"on {dev}; move the module to {dev} before wrapping it"
            )
        self.home_range = lo, hi = register_home(self, self.group, E)
        self.gate_up_proj = _home_parameter(gate_up_proj, lo, hi)
        self.down_proj = _home_parameter(down_proj, lo, hi)
        self.slots = resolve_slots(
            slots, num_experts=E, ranks=self.group.size, hidden=H, ffn=F, dtype=gate_up_proj.dtype
        )
        self.runtime = make_runtime(
            self.group,
            num_experts=E,
            slots=self.slots,
            hidden=H,
            ffn=F,
            top_k=top_k,
            align=align,
            dtype=gate_up_proj.dtype,
            max_tokens=max_tokens,
            transport=transport,
            balance=balance,
            what="MoonExperts",
            cost=cost,
        )

    def extra_repr(self) -> str:
        lo, hi = self.home_range
        return (
            f"num_experts={self.num_experts}, home=[{lo}, {hi}), hidden={self.hidden_dim}, "
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
        K, dev = self.top_k, self.group.device
        params: dict[str, torch.Tensor] = {"gate_up": self.gate_up_proj, "down": self.down_proj}
        if ok:
            msg = check_params(params, self.runtime.dtype, dev) or check_routing(
                ids_SK, weight_SK, x_SH.shape[0], self.num_experts, K, dev
            )
            ok = not msg
        if not ok or ids_SK is None:
            x_SH = torch.zeros(0, x_SH.shape[-1], dtype=self.runtime.dtype, device=dev)
            ids_SK, weight_SK = None, torch.zeros(0, K, device=dev)
        else:
            ids_SK = ids_SK.long()
        return self.runtime.forward(x_SH, ids_SK, weight_SK, params, ok, msg)

    def weights_changed(self) -> None:
        """Mark every slot stale after a change torch's version counters cannot see."""
        self.runtime.weights_changed()


def _group(group: EPGroup | object | None, weights_device: torch.device) -> EPGroup:
    """The EP group; without torch.distributed, a single rank on the weights' device."""
    if isinstance(group, EPGroup):
        return group
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return EPGroup(None, device=weights_device)
    return EPGroup(group)


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


def _home_parameter(full: torch.Tensor, lo: int, hi: int) -> nn.Parameter:
    """A Parameter holding a copy of ``full[lo:hi]`` (the full tensor is not referenced).

    It requires grad unless ``full`` is a Parameter that does not (frozen experts).
    """
    with torch.no_grad():
        home = full[lo:hi].detach().clone()
    trainable = full.requires_grad if isinstance(full, nn.Parameter) else True
    return nn.Parameter(home, requires_grad=trainable)
