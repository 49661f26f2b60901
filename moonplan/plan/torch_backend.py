"""The vectorised ``torch`` planner backend: the reference plan, bit for bit, on any device.

Legend: R ranks, E experts, B slots, M = ceil(E/R).

No value is read on the host on accelerators (CUDA-graph capturable); output
shapes depend only on ``(R, E, B)``. CPU tensors take the host form
(``host_backend.plan_host``, ``scan="host"``), where reading costs nothing and a Python or
numpy step is cheaper than a tensor op; the plans are the same, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moonplan.plan.from_alloc import home_layout, layout_fields
from moonplan.plan.host_backend import plan_host, steps12_host
from moonplan.plan.plan_fields import PlanFields
from moonplan.plan.torch_layout import place_slots_masked, replica_candidates
from moonplan.plan.torch_scan import balance_groups_torch, split_groups_torch


def plan_torch(
    counts_RE: torch.Tensor,
    num_slots: int,
    align: int,
    prev_RB: torch.Tensor | None,
    prev_F3: torch.Tensor | None = None,
    *,
    scan: str = "auto",
    target_R: torch.Tensor | None = None,
) -> PlanFields:
    """The plan's layout tensors (``reference.to_tensors``', bit for bit).

    Args:
        counts_RE: int64 ``[R, E]`` validated counts.
        num_slots: ``B``.
        align: row padding multiple.
        prev_RB: int64 ``[R, B]`` previous plan's slots, or ``None``.
        prev_F3: int64 ``[R-1, 3]`` previous plan's flows, or ``None``.
        scan: how the plan is built: ``"tensor"`` (masked tensor steps and slot
            placement, no host read on any device: the accelerator path), ``"host"``
            (Python integers and numpy, ``host_backend``: cheapest where the tensors are
            on the CPU) or ``"auto"`` (by device).
        target_R: int64 ``[R]`` targets replacing the exact ones (see
            ``reference.reference_plan``), or ``None``.
    """
    if _scan(scan, counts_RE.device) == "host":
        return plan_host(counts_RE, num_slots, align, prev_RB, prev_F3, target_R)
    R = counts_RE.shape[0]
    (target_R, home_E, ids_RM), (quota_RR, flow_F3, alloc_ER) = _steps12(
        counts_RE, prev_RB, prev_F3, target_R
    )
    cand_RM, _ = replica_candidates(quota_RR, ids_RM, alloc_ER)
    prev = prev_RB if prev_RB is not None else cand_RM.new_full((R, num_slots), -1)
    slots = place_slots_masked(cand_RM, prev, num_slots)
    homes = (home_E, ids_RM)
    return layout_fields(alloc_ER, homes, slots, align, target_R=target_R, flow_F3=flow_F3)


def alloc_torch(
    counts_RE: torch.Tensor,
    prev_RB: torch.Tensor | None = None,
    prev_F3: torch.Tensor | None = None,
    *,
    scan: str = "auto",
    target_R: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 ``[E, R]``: :func:`plan_torch`'s ``alloc`` alone (steps 1-2, no slots and no
    row layout; they do not depend on ``num_slots`` or ``align``). Arguments as there."""
    if _scan(scan, counts_RE.device) == "host":
        alloc_ER = steps12_host(counts_RE, prev_RB, prev_F3, target_R).alloc_ER
        return torch.from_numpy(alloc_ER).to(counts_RE.device)
    return _steps12(counts_RE, prev_RB, prev_F3, target_R)[1][2]


def _scan(scan: str, device: torch.device) -> str:
    """``"host"`` or ``"tensor"``: the form ``scan`` names (``"auto"``: host on the CPU)."""
    if scan == "auto":
        return "host" if device.type == "cpu" else "tensor"
    if scan not in ("host", "tensor"):
        raise ValueError(f"scan must be 'auto', 'host' or 'tensor', got {scan!r}")
    return scan


Steps12 = tuple[
    tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]
"""``((target_R, home_E, ids_RM), (quota_RR, flow_F3, alloc_ER))``: steps 1-2's targets,
home map and home groups, and their group quotas, flows and allocation."""


def _steps12(
    counts_RE: torch.Tensor,
    prev_RB: torch.Tensor | None,
    prev_F3: torch.Tensor | None,
    target_R: torch.Tensor | None,
) -> Steps12:
    """Steps 1-2 as masked tensor steps (no host read); every tensor on the counts' device."""
    R, E = counts_RE.shape
    dev = counts_RE.device
    home_E, ids_RM = home_layout(E, R, dev)
    T_E = counts_RE.sum(0)
    if target_R is None:
        N = T_E.sum()
        target_R = N // R + (torch.arange(R, device=dev) < N % R).to(torch.int64)
    load_R = torch.zeros(R, dtype=torch.int64, device=dev).index_add_(0, home_E, T_E)
    step = Steps12Inputs(load_R, target_R, T_E, home_E, prev_RB, prev_F3)
    return (target_R, home_E, ids_RM), alloc_tensor(step, ids_RM, stop_early=False)


@dataclass(frozen=True)
class Steps12Inputs:
    """The inputs of steps 1-2 (int64 tensors on the counts' device)."""

    load_R: torch.Tensor
    target_R: torch.Tensor
    T_E: torch.Tensor
    home_E: torch.Tensor
    prev_RB: torch.Tensor | None
    prev_F3: torch.Tensor | None


def alloc_tensor(
    step: Steps12Inputs, ids_RM: torch.Tensor, stop_early: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-2 as masked tensor steps: ``(quota_RR, flow_F3, alloc_ER)`` (no host read
    unless ``stop_early``; ``None``: stop early on CPU only)."""
    load_R, target_R, T_E, home_E = step.load_R, step.target_R, step.T_E, step.home_E
    prev_RB, prev_F3 = step.prev_RB, step.prev_F3
    R, E = load_R.shape[0], T_E.shape[0]
    dev = load_R.device
    resident_ER = warm_RR = None
    if prev_RB is not None:
        resident_ER = resident_map(prev_RB, E)
        warm_RR = torch.zeros(R, R, dtype=torch.int64, device=dev)
        warm_RR.index_add_(0, home_E, resident_ER.to(torch.int64))
        warm_RR = warm_RR > 0
    quota_RR, flow_F3 = balance_groups_torch(
        load_R, load_R - target_R, warm_RR, prev_F3, stop_early
    )
    rem_RM = torch.where(ids_RM < E, T_E[ids_RM.clamp(max=E - 1)], 0)
    alloc_ER = torch.zeros(E, R, dtype=torch.int64, device=dev)
    split_groups_torch(quota_RR.clone(), ids_RM, rem_RM, resident_ER, alloc_ER, stop_early)
    r_R = torch.arange(R, device=dev)
    home_RM = ids_RM.clamp(max=E - 1)
    alloc_ER.view(-1).index_add_(0, (home_RM * R + r_R[:, None]).view(-1), rem_RM.view(-1))
    return quota_RR, flow_F3, alloc_ER


def resident_map(prev_RB: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E, R]`` bool: expert ``e`` sits in one of rank ``r``'s previous slots."""
    R, B = prev_RB.shape
    res_ER = torch.zeros(num_experts + 1, R, dtype=torch.bool, device=prev_RB.device)
    e_RB = torch.where(prev_RB >= 0, prev_RB, num_experts)
    r_RB = torch.arange(R, device=prev_RB.device)[:, None].expand(R, B)
    res_ER[e_RB, r_RB] = True
    return res_ER[:num_experts]
