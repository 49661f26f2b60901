"""Step 3 of the planner on the host (numpy): replicas, slots, direct replicas, rows.

Legend:
    R ranks, E experts, B slots, M = ceil(E/R), D = max(0, K - B) direct rows
    K candidate columns per rank (``M`` for the planner, ``max(B, M)`` for ``from_alloc``)
    W = M + B + D rows per rank
    ids_RM    experts of each home group (``E`` where the group has fewer than ``M``)
    cand_RK   each rank's replicas in placement order (largest first), ``-1`` padded
    prev_RB   previous plan's slots (``-1``: empty)

The CPU form of ``torch_layout`` (the same arrays, bit for bit, tested against it and the
reference): on the CPU a numpy op on these small arrays costs about a microsecond, a torch
op several. Without residents the slots are the first replicas in order; with residents
every rank is placed at once by masks (``torch_layout.place_slots_masked``'s rule), with
no loop over ranks.
"""

from __future__ import annotations

import numpy as np


def candidates_from_moves(
    moves: list[tuple[int, int, int]], num_ranks: int, width: int
) -> np.ndarray:
    """``cand_RM`` int64 ``[R, width]``: each rank's replicas, most records first (ties:
    lower id), ``-1`` padded: ``torch_layout.replica_candidates`` read off step 2's moves.

    Args:
        moves: ``(expert, rank, records)``, each ``(expert, rank)`` once
            (``group_flows.HostMoves``): a rank's moves are its replicas, all from the one
            donor group that fills it (so at most ``M <= width`` of them).
        num_ranks, width: ``R`` and the columns (``M``).
    """
    cand_RM = np.full((num_ranks, width), -1, dtype=np.int64)
    if moves:
        keyed = sorted((r, -q, e) for e, r, q in moves)  # by rank, then the placement order
        r_X = np.array([k[0] for k in keyed], dtype=np.int64)
        col_X = np.arange(len(keyed)) - np.searchsorted(r_X, r_X)  # place within the rank
        cand_RM[r_X, col_X] = [k[2] for k in keyed]
    return cand_RM


def place_slots_host_np(
    cand_RK: np.ndarray, prev_RB: np.ndarray | None, num_slots: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``reference.place_slots`` for every rank: ``(slot_RB, new_RB, direct_RD)`` int64.

    Args:
        cand_RK: int64 ``[R, K]`` replicas in placement order, ``-1`` padded at the end.
        prev_RB: int64 ``[R, B]`` previous slots (``-1``: empty), or ``None``.
        num_slots: ``B``.

    Without residents (every previous slot empty) a rank fills its slots in order, so
    its first ``B`` candidates are its slots (all new) and the rest are direct; with
    some, every rank is placed by :func:`_place_with_residents`.
    """
    R, K = cand_RK.shape
    if prev_RB is not None and bool((prev_RB >= 0).any()):
        return _place_with_residents(cand_RK, prev_RB, num_slots)
    B = num_slots
    slot_RB = np.full((R, B), -1, dtype=np.int64)
    slot_RB[:, : min(B, K)] = cand_RK[:, :B]
    new_RB = (slot_RB >= 0).astype(np.int64)
    return slot_RB, new_RB, cand_RK[:, B:].astype(np.int64)  # a copy: never a view


def _place_with_residents(
    cand_RK: np.ndarray, prev_RB: np.ndarray, num_slots: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`place_slots_host_np` by masks over every rank at once (``B >= 1``): new
    replicas (not resident) in order take the free slots (empty ones first, then those
    whose resident is unused, in slot order); the rest are direct, in order."""
    R, K = cand_RK.shape
    B, D = num_slots, max(0, K - num_slots)
    valid_RK = cand_RK >= 0
    res_RK = valid_RK & (cand_RK[:, :, None] == prev_RB[:, None, :]).any(2)
    kept_RB = (prev_RB[:, :, None] == np.where(valid_RK, cand_RK, -2)[:, None, :]).any(2)
    new_RK = valid_RK & ~res_RK
    order_RK = np.argsort(~new_RK, axis=1, kind="stable")  # new replicas first, in order
    n_new_R = new_RK.sum(1, keepdims=True)
    new_RK = np.where(np.arange(K) < n_new_R, np.take_along_axis(cand_RK, order_RK, 1), -1)
    cat_RB = np.where(prev_RB < 0, 0, np.where(kept_RB, 2, 1))
    free_RB = np.argsort(cat_RB, axis=1, kind="stable")  # empty, unused resident; in order
    n_free_R = (cat_RB < 2).sum(1, keepdims=True)
    i_K = np.arange(K)
    to_slot_RK = (i_K < n_new_R) & (i_K < n_free_R)
    col_RK = np.where(to_slot_RK, free_RB[:, np.minimum(i_K, B - 1)], B)  # B: discarded
    r_R1 = np.arange(R)[:, None]
    slot_RB = np.concatenate([prev_RB, np.full((R, 1), -1, dtype=np.int64)], 1)
    slot_RB[r_R1, col_RK] = np.where(to_slot_RK, new_RK, -1)
    new_RB = np.zeros((R, B + 1), dtype=np.int64)
    new_RB[r_R1, col_RK] = to_slot_RK
    to_direct_RK = (i_K < n_new_R) & ~to_slot_RK
    direct_RD = np.full((R, D + 1), -1, dtype=np.int64)
    direct_RD[r_R1, np.where(to_direct_RK, i_K - n_free_R, D)] = np.where(to_direct_RK, new_RK, -1)
    return slot_RB[:, :B], new_RB[:, :B], direct_RD[:, :D]


def row_layout_host(
    home_RM: np.ndarray,
    slot_RB: np.ndarray,
    direct_RD: np.ndarray,
    alloc_ER: np.ndarray,
    align: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(row_RW, count_RW, offset_RW1)`` int64: ``torch_layout.row_layout_torch`` on host
    arrays (home rows ``home_RM``, ``-1`` padded, then slots and direct rows; their
    records; ``align``-padded offsets)."""
    R = slot_RB.shape[0]
    row_RW = np.concatenate([home_RM, slot_RB, direct_RD], 1)
    count_RW = alloc_ER[np.maximum(row_RW, 0), np.arange(R)[:, None]]
    count_RW[row_RW < 0] = 0
    padded_RW = count_RW if align == 1 else (count_RW + (align - 1)) // align * align
    offset_RW1 = np.zeros((R, row_RW.shape[1] + 1), dtype=np.int64)
    np.cumsum(padded_RW, 1, out=offset_RW1[:, 1:])
    return row_RW, count_RW, offset_RW1
