"""Plain-order routing on the host (numpy): the CPU form of :func:`moonplan.route`.

Legend:
    R ranks, E experts, S tokens on this rank, K top-k, N = S*K records of this rank
    W rows per rank; L live rows of the plan (``row_count > 0``), sorted by (expert, rank)

The same destinations and offsets as ``route``'s tensor form (``route._row_cells`` and
``route._place_runs``), bit for bit (``tests/plan/test_route_host.py``), for CPU tensors:
numpy reads them without a copy, a numpy op on the ``[L]`` arrays costs about a
microsecond against several for a torch op, and the ``[N]`` work is a few passes (one
stable radix sort of 16-bit keys, one run expansion, one add, one scatter of the
destination packed with its offset, one unpacking). ``route`` takes this form on the CPU
without ``affinity``; its check counts the 16-bit keys (:func:`counts_host`).
"""

from __future__ import annotations

import numpy as np
import torch

from moonplan.plan.plan_type import Plan

OFFSET_BITS = 40
"""A record's destination and offset travel packed as ``(rank << 40) + offset``: receive
offsets stay far below ``2**40`` rows (``Route.send_order`` packs the same way)."""


def sort_keys(ids_N: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 ids ``[N]`` as the narrowest keys numpy radix-sorts: ``uint16`` for up to
    65535 experts (about 10% faster than ``int16``), else ``int32``."""
    return ids_N.astype(np.uint16 if num_experts <= np.iinfo(np.uint16).max else np.int32)


def route_host(plan: Plan, rank: int, keys_N: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(dest_rank_N, dest_offset_N, send_counts_R)`` int64 of ``rank``'s records.

    Args:
        plan: the step's plan (CPU tensors).
        rank: the source rank.
        keys_N: ``[N]`` expert ids, token-major, as :func:`sort_keys` (counts matching
            ``plan.counts[rank]``).
    """
    order_N = np.argsort(keys_N, kind="stable")  # by expert, local order kept
    take_L, base_L, dest_L = row_cells_host(plan, rank)
    N = keys_N.size
    # The i-th record of the sorted order lands at base + i of its cell's destination.
    packed_N = np.repeat((dest_L << OFFSET_BITS) + base_L, take_L)
    packed_N += np.arange(N, dtype=np.int64)
    out_N = np.empty(N, dtype=np.int64)
    out_N[order_N] = packed_N
    offset_N = out_N & ((1 << OFFSET_BITS) - 1)
    dest_N = np.right_shift(out_N, OFFSET_BITS, out=out_N)  # in place: one buffer less
    send_R = np.zeros(plan.num_ranks, dtype=np.int64)
    np.add.at(send_R, dest_L, take_L)
    return dest_N, offset_N, send_R


def counts_host(ids_N: np.ndarray, keys_N: np.ndarray, num_experts: int) -> torch.Tensor:
    """int64 ``[E]`` records per expert of ids already checked to lie in ``[0, E)``: a
    bincount of the 16-bit keys where they fit ``int16`` (a quarter of the int64 bytes)."""
    if keys_N.dtype == np.uint16 and num_experts <= np.iinfo(np.int16).max + 1:
        return torch.bincount(torch.from_numpy(keys_N.view(np.int16)), minlength=num_experts)
    return torch.from_numpy(np.bincount(ids_N, minlength=num_experts))


def row_cells_host(plan: Plan, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``route._row_cells`` over the live rows only: ``(take_L, base_L, dest_L)`` int64.

    Lay all records on one line: experts in id order, inside an expert by source rank,
    then local order. The rows executing expert ``e`` (ascending rank) cut ``e``'s
    stretch into consecutive segments; ``rank`` owns ``[lo, hi)`` of it, and a row takes
    the overlap: ``take`` records, the ``i``-th record of ``rank``'s expert-sorted order
    landing at ``base + i`` of the row's rank ``dest``.
    """
    R, W = plan.num_ranks, plan.num_rows
    row_e = plan.row_expert.numpy().reshape(-1)
    row_count = plan.row_count.numpy().reshape(-1)
    live_L = np.flatnonzero(row_count)
    live_L = live_L[np.argsort(row_e[live_L] * R + live_L // W)]  # unique keys
    e_L, count_L, dest_L = row_e[live_L], row_count[live_L], live_L // W
    end_L = np.cumsum(count_L)
    start_L = end_L - count_L  # the row's segment on the line
    # e's stretch starts where its first row's segment does; rank owns [lo, hi) of it
    counts = plan.counts.numpy()
    lo_L = start_L[np.searchsorted(e_L, e_L)] + counts[:rank].sum(0)[e_L]
    hi_L = lo_L + counts[rank][e_L]
    first_L = np.maximum(start_L, lo_L)
    take_L = np.maximum(np.minimum(end_L, hi_L) - first_L, 0)
    run_L = np.cumsum(take_L) - take_L  # where the row's records start in sorted order
    # row_offset is [R, W + 1]: row (r, w) starts at flat index r * (W + 1) + w
    base_L = plan.row_offset.numpy().reshape(-1)[live_L + dest_L] + (first_L - start_L) - run_L
    return take_L, base_L, dest_L
