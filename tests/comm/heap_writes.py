"""The peer-write check every symmetric-heap backend's tests run (``shm``, ``ipc``).

Legend: R ranks (``world``); each symmetric tensor is ``[R, 3]``, row ``s`` written by rank
``s`` into every peer's copy.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.comm.heap import SymmetricHeap

DTYPES = [torch.float32, torch.bfloat16, torch.int64]
"""One symmetric tensor of each of these per check."""


def write_to_peers(heap: SymmetricHeap, rank: int, world: int) -> dict[str, Any]:
    """On every rank at once: allocate one ``[R, 3]`` tensor per dtype of :data:`DTYPES`,
    write row ``rank`` of every peer's copy with ``(rank, peer, 7)``, barrier, then return
    ``got`` (each tensor's local copy as float lists), ``offsets`` and ``ptrs`` (the first
    tensor's peer addresses). Checks the heap's consistency and leaves it open."""
    syms = [heap.alloc((world, 3), dtype) for dtype in DTYPES]
    for sym in syms:
        for peer in range(world):  # row `rank` of every peer's copy: written by this rank
            sym.peer(peer)[rank] = torch.tensor([rank, peer, 7]).to(sym.dtype)
    heap.barrier()
    got = [sym.local.to(torch.float64).tolist() for sym in syms]
    heap.check_consistent()
    return {"got": got, "offsets": [s.offset for s in syms], "ptrs": syms[0].peer_ptrs().tolist()}


def expected_rows(rank: int, world: int) -> list[list[list[float]]]:
    """What :func:`write_to_peers` returns as ``got`` on ``rank``: one ``[R, 3]`` list a dtype."""
    return [[[float(src), float(rank), 7.0] for src in range(world)]] * len(DTYPES)
