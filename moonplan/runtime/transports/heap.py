"""The heap transport: records and weight rows move by direct peer stores and loads.

Legend:
    R ranks, N records (or rows fetched), H hidden, C receive capacity

Every rank's receive and output buffers ``[C, H]`` are allocations of one
symmetric heap (``shm`` on CPU, ``nvshmem`` on GPU: :mod:`moonplan.comm.heap`),
so a dispatch stores rows straight into the executing rank's receive buffer and
the expert layer reads them there (zero copy); combine loads each record's output
from the executing rank's output buffer. A barrier makes writes visible
(:meth:`publish`); :meth:`fetch_rows` is plain peer loads (``one_sided``), which
the overlapped schedule runs in a background thread or side stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap, SymTensor
from moonplan.runtime.row_ops import row_ops_for
from moonplan.runtime.transports.base import SharedRows
from moonplan.runtime.transports.records import RecordTransport


class HeapTransport(RecordTransport):
    """Per-record transport over a symmetric heap (see the module docstring)."""

    name = "heap"
    one_sided = True

    def __init__(
        self, group: EPGroup, heap: SymmetricHeap, capacity: int, hidden: int, dtype: torch.dtype
    ):
        self.heap = heap
        self.recv, self.out = (heap.alloc((capacity, hidden), dtype) for _ in range(2))
        super().__init__(group, capacity, self.recv.local, self.out.local)

    def publish(self) -> None:
        """Collective: every rank's writes to its heap buffers are visible (a barrier)."""
        self.heap.barrier()

    def _scatter(
        self, x_XH: torch.Tensor, dest_N: torch.Tensor, off_N: torch.Tensor, K: int
    ) -> None:
        # Nobody writes a peer's rows before that peer is done with its previous view
        # (every rank has reached this dispatch), so a view stays valid until its
        # owner's next dispatch, whatever the peers do meanwhile.
        self.heap.barrier()
        row_ops_for(x_XH.device).scatter_rows(x_XH, dest_N, off_N, K, self._peers(self.recv))
        self.heap.barrier()  # every peer's rows have landed

    def _gather(self, dest_N: torch.Tensor, off_N: torch.Tensor, publish: bool) -> torch.Tensor:
        if publish:
            self.heap.barrier()
        return self.fetch_rows(self.out, dest_N, off_N)

    def _peers(self, sym: SymTensor) -> list[torch.Tensor]:
        """Every rank's copy of ``sym`` (``R`` views, rank order)."""
        return [sym.peer(r) for r in range(self.group.size)]

    def alloc_shared(self, shape: Sequence[int], dtype: torch.dtype) -> SymTensor:
        """A symmetric allocation of the heap (``.local`` and ``.peer(r)``)."""
        return self.heap.alloc(shape, dtype)

    def fetch_rows(
        self, buffer: SharedRows, src_rank_N: torch.Tensor, src_row_N: torch.Tensor
    ) -> torch.Tensor:
        """Peer loads (no collective): ``[n, ...]`` rows of other ranks' ``buffer``."""
        if not isinstance(buffer, SymTensor):
            raise TypeError(f"heap transport reads heap buffers only, got {type(buffer)}")
        views = self._peers(buffer)
        local = buffer.local
        got = torch.empty(
            src_rank_N.numel(), *local.shape[1:], dtype=local.dtype, device=local.device
        )
        row_ops_for(got.device).gather_rows(views, src_rank_N, src_row_N, got)
        return got
