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
op several, and a rank without residents needs no Python loop: its replicas take the
slots in order and the rest are direct. Only ranks with residents run
``reference.place_slots``.
"""

from __future__ import annotations

import numpy as np

from moonplan.plan.reference import place_slots


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

    A rank with no resident (every previous slot empty) fills its slots in order, so its
    first ``B`` candidates are its slots (all new) and the rest are direct.
    """
    R, K = cand_RK.shape
    B, D = num_slots, max(0, K - num_slots)
    slot_RB = np.full((R, B), -1, dtype=np.int64)
    slot_RB[:, : min(B, K)] = cand_RK[:, :B]
    new_RB = (slot_RB >= 0).astype(np.int64)
    direct_RD = cand_RK[:, B:].astype(np.int64)  # a copy: never a view of the input
    if prev_RB is None:
        return slot_RB, new_RB, direct_RD
    for r in np.flatnonzero((prev_RB >= 0).any(1)).tolist():
        reps = [e for e in cand_RK[r].tolist() if e >= 0]
        # records that sort like the given order (largest first): the candidates' rank
        slot, new, direct = place_slots(
            [(e, -i) for i, e in enumerate(reps)], prev_RB[r].tolist(), B
        )
        slot_RB[r], new_RB[r] = slot, new
        direct_RD[r] = direct + [-1] * (D - len(direct))
    return slot_RB, new_RB, direct_RD


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
