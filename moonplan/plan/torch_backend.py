"""The vectorised ``torch`` planner backend: the reference plan, bit for bit, on any device.

Legend: R ranks, E experts, B slots, M = ceil(E/R).

No value is read on the host on accelerators (CUDA-graph capturable); output
shapes depend only on ``(R, E, B)``.
"""

from __future__ import annotations

import torch

from moonplan.plan.home import home_map
from moonplan.plan.torch_layout import (
    group_experts,
    place_slots_torch,
    replica_candidates,
    row_layout_torch,
)
from moonplan.plan.torch_scan import balance_groups_torch, split_groups_torch


def plan_torch(
    counts_RE: torch.Tensor, num_slots: int, align: int, prev_RB: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The plan's tensors (same keys as ``reference.to_tensors``).

    Args:
        counts_RE: int64 ``[R, E]`` validated counts.
        num_slots: ``B``.
        align: row padding multiple.
        prev_RB: int64 ``[R, B]`` previous plan's slots, or ``None``.
    """
    R, E = counts_RE.shape
    dev = counts_RE.device
    home_E = home_map(E, R, device=dev)
    T_E = counts_RE.sum(0)
    N = T_E.sum()
    r_R = torch.arange(R, device=dev)
    target_R = N // R + (r_R < N % R).to(torch.int64)
    load_R = torch.zeros(R, dtype=torch.int64, device=dev).index_add_(0, home_E, T_E)

    resident_ER = warm_RR = None
    if prev_RB is not None:
        resident_ER = _resident(prev_RB, E)
        warm_RR = torch.zeros(R, R, dtype=torch.int64, device=dev)
        warm_RR.index_add_(0, home_E, resident_ER.to(torch.int64))
        warm_RR = warm_RR > 0
    quota_RR = balance_groups_torch(load_R, target_R, warm_RR)

    ids_RM = group_experts(E, R, dev)
    rem_RM = torch.where(ids_RM < E, T_E[ids_RM.clamp(max=E - 1)], 0)
    alloc_ER = torch.zeros(E, R, dtype=torch.int64, device=dev)
    split_groups_torch(quota_RR.clone(), ids_RM, rem_RM, resident_ER, alloc_ER)
    home_RM = ids_RM.clamp(max=E - 1)
    alloc_ER.view(-1).index_add_(0, (home_RM * R + r_R[:, None]).view(-1), rem_RM.view(-1))

    cand_RM, _ = replica_candidates(quota_RR, ids_RM, alloc_ER)
    prev = prev_RB if prev_RB is not None else cand_RM.new_full((R, num_slots), -1)
    slot_RB, new_RB, direct_RD = place_slots_torch(cand_RM, prev, num_slots)
    row_RW, count_RW, offset_RW1 = row_layout_torch(ids_RM, slot_RB, direct_RD, alloc_ER, align)
    return {
        "alloc": alloc_ER,
        "target": target_R,
        "home": home_E,
        "slot_expert": slot_RB,
        "slot_new": new_RB,
        "row_expert": row_RW,
        "row_count": count_RW,
        "row_offset": offset_RW1,
    }


def _resident(prev_RB: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E, R]`` bool: expert ``e`` sits in one of rank ``r``'s previous slots."""
    R, B = prev_RB.shape
    res_ER = torch.zeros(num_experts + 1, R, dtype=torch.bool, device=prev_RB.device)
    e_RB = torch.where(prev_RB >= 0, prev_RB, num_experts)
    r_RB = torch.arange(R, device=prev_RB.device)[:, None].expand(R, B)
    res_ER[e_RB, r_RB] = True
    return res_ER[:num_experts]
