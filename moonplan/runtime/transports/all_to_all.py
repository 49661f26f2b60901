"""The all-to-all transport: the same rows as the heap's, moved by ``torch.distributed``.

Legend:
    R ranks, N records (or rows fetched), H hidden, C receive capacity

Where no symmetric heap spans the group (several hosts on CPU, GPUs without
NVSHMEM) every movement is a collective of :mod:`moonplan.comm.a2a`: dispatch
exchanges the record rows, combine and :meth:`fetch_rows` ask each owner for
its rows. The buffers are plain local tensors and :meth:`publish` has nothing to
do; ``fetch_rows`` is a collective (not ``one_sided``), so nothing runs in the
background.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moonplan.comm import a2a
from moonplan.comm.group import EPGroup
from moonplan.runtime.transports.base import SharedRows
from moonplan.runtime.transports.records import RecordTransport


@dataclass
class LocalRows:
    """A shared buffer of the all-to-all transport: this rank's tensor, served on request."""

    local: torch.Tensor


class AllToAllTransport(RecordTransport):
    """Per-record transport over all-to-alls (see the module docstring)."""

    name = "a2a"
    one_sided = False

    def __init__(self, group: EPGroup, capacity: int, hidden: int, dtype: torch.dtype):
        recv_CH, out_CH = (
            torch.zeros(capacity, hidden, dtype=dtype, device=group.device) for _ in range(2)
        )
        super().__init__(group, capacity, recv_CH, out_CH)

    def publish(self) -> None:
        """Nothing to publish: all-to-alls carry the rows themselves."""

    def _scatter(
        self, x_XH: torch.Tensor, dest_N: torch.Tensor, off_N: torch.Tensor, K: int
    ) -> None:
        n_N = torch.arange(dest_N.numel(), device=x_XH.device) // K
        a2a.exchange_rows(self.group, x_XH[n_N], dest_N, off_N, self.recv_CH)

    def _gather(self, dest_N: torch.Tensor, off_N: torch.Tensor, publish: bool) -> torch.Tensor:
        return a2a.gather_rows(self.group, self.out_CH, dest_N, off_N)

    def alloc_shared(self, shape: Sequence[int], dtype: torch.dtype) -> LocalRows:
        """A zeroed local tensor (peers get its rows through :meth:`fetch_rows`)."""
        return LocalRows(torch.zeros(*shape, dtype=dtype, device=self.group.device))

    def fetch_rows(
        self, buffer: SharedRows, src_rank_N: torch.Tensor, src_row_N: torch.Tensor
    ) -> torch.Tensor:
        """Collective: ``[n, ...]`` rows of other ranks' ``buffer`` (every rank calls it)."""
        local = buffer.local
        flat = local.view(local.shape[0], -1)
        got = a2a.gather_rows(self.group, flat, src_rank_N, src_row_N)
        return got.view(-1, *local.shape[1:])
