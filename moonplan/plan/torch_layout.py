"""Torch twin of the reference planner's step 3: slots, direct replicas, rows, offsets.

Legend:
    R ranks, E experts, B slots, M = ceil(E/R), D = max(0, M - B) direct rows, W = M + B + D
    cand_RM   candidate remote experts of each rank (the one group that fills it), -1 if none
    rec_RM    their records on that rank
    prev_RB   previous plan's slots (-1 everywhere without ``previous=``)

Every receiver is filled by exactly one donor group, so a rank's replicas are
among that group's at most ``M`` experts: all per-rank work is on ``[R, M]``
and ``[R, B]`` tensors, vectorised over ranks.
"""

from __future__ import annotations

import torch

from moonplan.host_arrays import host_int64
from moonplan.plan.host_layout import place_slots_host_np


def replica_candidates(
    quota_RR: torch.Tensor, ids_RM: torch.Tensor, alloc_ER: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's replicas, largest first (ties: lower id), padded with ``-1`` / 0.

    Args:
        quota_RR: ``[donor, receiver]`` group flows of step 1 (before the split).
        ids_RM: the experts of each home group, ``E`` where the group has fewer than
            ``M`` (``from_alloc.home_layout``).
        alloc_ER: the allocation.

    Returns:
        ``(cand_RM, rec_RM)``: expert ids and their records on each rank, sorted.
    """
    R, E = quota_RR.shape[0], alloc_ER.shape[0]
    has_R = (quota_RR > 0).any(0)
    src_R = torch.argmax((quota_RR > 0).to(torch.int8), dim=0)
    ids_RM = ids_RM[src_R]
    r_R = torch.arange(R, device=alloc_ER.device)
    rec_RM = alloc_ER[ids_RM.clamp(max=E - 1), r_R[:, None]]
    rec_RM = torch.where((ids_RM < E) & has_R[:, None], rec_RM, 0)
    rec_RM, order_RM = torch.sort(rec_RM, dim=1, descending=True, stable=True)
    cand_RM = torch.where(rec_RM > 0, ids_RM.gather(1, order_RM), -1)
    return cand_RM, rec_RM


def place_slots_torch(
    cand_RM: torch.Tensor, prev_RB: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 3 (``reference.place_slots``) for every rank at once.

    Args:
        cand_RM: int64 ``[R, M]`` each rank's replicas in placement order (largest
            first), ``-1`` padded.
        prev_RB: int64 ``[R, B]`` the previous slots (``-1``: empty).
        num_slots: ``B``.

    Returns:
        ``(slot_RB, new_RB, direct_RD)``: slot experts, 1 where filled this step,
        and the replicas beyond the slots (``-1`` padded), all int64.

    CPU tensors are placed on the host (:func:`place_slots_host`: a few numpy ops, and list
    operations for ranks with residents, cost less than the ~40 tensor ops of the masked form);
    any other device runs the masked form (:func:`place_slots_masked`: no host read).
    """
    if cand_RM.device.type == "cpu":
        return place_slots_host(cand_RM, prev_RB, num_slots)
    return place_slots_masked(cand_RM, prev_RB, num_slots)


def place_slots_host(
    cand_RM: torch.Tensor, prev_RB: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`place_slots_torch` on host arrays (``host_layout.place_slots_host_np``: ranks
    without residents at once, the others by ``reference.place_slots``); the tensors are
    read to the host, so this is the CPU form."""
    out = place_slots_host_np(host_int64(cand_RM), host_int64(prev_RB), num_slots)
    return tuple(torch.from_numpy(a).to(cand_RM.device) for a in out)  # type: ignore[return-value]


def place_slots_masked(
    cand_RM: torch.Tensor, prev_RB: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`place_slots_torch` as masked tensor ops on every rank at once (any device,
    no host read, CUDA-graph capturable)."""
    R, M = cand_RM.shape
    B, D = num_slots, max(0, M - num_slots)
    dev = cand_RM.device
    valid_RM = cand_RM >= 0
    res_RM = valid_RM & (cand_RM[:, :, None] == prev_RB[:, None, :]).any(-1)
    kept_RB = (prev_RB[:, :, None] == torch.where(valid_RM, cand_RM, -2)[:, None, :]).any(-1)
    kept_RB &= prev_RB >= 0
    # New replicas (not resident), in order; the rest move to the end.
    order_RM = torch.sort((~valid_RM | res_RM).to(torch.int8), dim=1, stable=True).indices
    new_RM = torch.where((valid_RM & ~res_RM).gather(1, order_RM), cand_RM.gather(1, order_RM), -1)
    n_new_R = (new_RM >= 0).sum(1)
    # Free slots: empty ones first, then ones whose resident is unused, in slot order.
    j_B = torch.arange(B, device=dev)
    cat_RB = torch.where(prev_RB < 0, 0, torch.where(kept_RB, 2, 1))
    free_RB = torch.sort(cat_RB * B + j_B, dim=1).values % max(B, 1)
    n_free_R = (cat_RB < 2).sum(1)
    i_M = torch.arange(M, device=dev)
    to_slot_RM = (i_M < n_new_R[:, None]) & (i_M < n_free_R[:, None])
    slot_idx_RM = free_RB.gather(1, i_M.clamp(max=max(B - 1, 0)).expand(R, M)) if B else i_M * 0
    slot_idx_RM = torch.where(to_slot_RM, slot_idx_RM, B)  # column B is discarded
    slot_RB = torch.cat([prev_RB, prev_RB.new_full((R, 1), -1)], 1)
    slot_RB = slot_RB.scatter(1, slot_idx_RM, new_RM)[:, :B]
    new_RB = torch.zeros(R, B + 1, dtype=torch.int64, device=dev)
    new_RB = new_RB.scatter(1, slot_idx_RM, to_slot_RM.to(torch.int64))[:, :B]
    to_direct_RM = (i_M < n_new_R[:, None]) & ~to_slot_RM
    d_idx_RM = torch.where(to_direct_RM, i_M - n_free_R[:, None], D)
    direct_RD = torch.full((R, D + 1), -1, dtype=torch.int64, device=dev)
    direct_RD = direct_RD.scatter(1, d_idx_RM.clamp(min=0), torch.where(to_direct_RM, new_RM, -1))
    return slot_RB, new_RB, direct_RD[:, :D]


def row_layout_torch(
    ids_RM: torch.Tensor,
    slot_RB: torch.Tensor,
    direct_RD: torch.Tensor,
    alloc_ER: torch.Tensor,
    align: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of every rank (``reference.row_layout``): experts, records, padded offsets."""
    R, E = slot_RB.shape[0], alloc_ER.shape[0]
    home_RM = torch.where(ids_RM < E, ids_RM, -1)
    row_RW = torch.cat([home_RM, slot_RB, direct_RD], 1)
    r_R = torch.arange(R, device=alloc_ER.device)
    count_RW = torch.where(row_RW >= 0, alloc_ER[row_RW.clamp(min=0), r_R[:, None]], 0)
    padded_RW = (count_RW + (align - 1)) // align * align
    offset_RW1 = torch.cat([padded_RW.new_zeros(R, 1), padded_RW.cumsum(1)], 1)
    return row_RW, count_RW, offset_RW1
