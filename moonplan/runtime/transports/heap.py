"""The heap transports: rows move by direct peer stores and loads on a symmetric heap.

Legend:
    R ranks, N rows moved (or fetched), H hidden, C receive capacity

Every rank's shared buffers are allocations of one symmetric heap (``shm`` on CPU,
``nvshmem`` or ``ipc`` on GPU: :mod:`moonplan.comm.heap`), so a put stores rows straight into
the peer's buffer and a fetch loads them from it; a barrier makes writes visible
(:meth:`HeapRows.publish`); :meth:`HeapRows.fetch_rows` is plain peer loads
(``one_sided``), which the overlapped schedule runs in a background thread or side
stream. :class:`HeapTransport` sends one row per record (the expert layer reads the
receive rows in the heap: zero copy); :class:`HeapTokenTransport` one row per
``(token, destination rank)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap, SymTensor
from moonplan.runtime.row_ops import row_ops_for
from moonplan.runtime.transports.base import SharedRows
from moonplan.runtime.transports.moves import Put, RowMoves
from moonplan.runtime.transports.records import RecordTransport
from moonplan.runtime.transports.tokens import TokenTransport


class HeapRows(RowMoves):
    """The row movements of a symmetric heap (``self.heap``)."""

    one_sided = True

    def __init__(
        self, group: EPGroup, heap: SymmetricHeap, capacity: int, hidden: int, dtype: torch.dtype
    ):
        self.heap = heap  # before the data path allocates its buffers on it
        super().__init__(group, capacity, hidden, dtype)  # type: ignore[call-arg]

    def publish(self) -> None:
        """Collective: every rank's writes to its heap buffers are visible (a barrier)."""
        self.heap.barrier()

    def put_rows(self, puts: Sequence[Put]) -> None:
        """Collective: peer stores between two barriers (see :class:`RowMoves`)."""
        # Nobody writes a peer's rows before that peer is done with its previous
        # contents (every rank has reached this call).
        self.heap.barrier()
        for p in puts:
            if not isinstance(p.buffer, SymTensor):
                raise TypeError(f"heap transport writes heap buffers only, got {type(p.buffer)}")
            ops = row_ops_for(p.rows.device)
            ops.scatter_rows(p.rows, p.dest, p.off, p.top_k, self._peers(p.buffer))
        self.heap.barrier()  # every peer's rows have landed

    def _peers(self, sym: SymTensor) -> list[torch.Tensor]:
        """Every rank's copy of ``sym`` (``R`` views, rank order)."""
        return [sym.peer(r) for r in range(self.group.size)]

    def alloc_shared(self, shape: Sequence[int], dtype: torch.dtype) -> SymTensor:
        """A symmetric allocation of the heap (``.local`` and ``.peer(r)``)."""
        return self.heap.alloc(shape, dtype)

    def fetch_rows(
        self, buffer: SharedRows, src_rank_N: Tensor, src_row_N: Tensor, *, check: bool = True
    ) -> Tensor:
        """Peer loads (no collective): ``[n, ...]`` rows of other ranks' ``buffer``
        (checked locally either way: ``check`` is the all-to-all's collective check)."""
        if not isinstance(buffer, SymTensor):
            raise TypeError(f"heap transport reads heap buffers only, got {type(buffer)}")
        views = self._peers(buffer)
        local = buffer.local
        got = torch.empty(
            src_rank_N.numel(), *local.shape[1:], dtype=local.dtype, device=local.device
        )
        row_ops_for(got.device).gather_rows(views, src_rank_N, src_row_N, got)
        return got


class HeapTransport(HeapRows, RecordTransport):
    """Per-record transport over a symmetric heap (see the module docstring)."""


class HeapTokenTransport(HeapRows, TokenTransport):
    """Token-once transport over a symmetric heap (see the module docstring)."""
