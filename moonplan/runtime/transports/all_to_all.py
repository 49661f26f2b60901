"""The all-to-all transports: the heap's rows, moved by ``torch.distributed``.

Legend:
    R ranks, N rows moved (or fetched), X rows of a sent tensor, H hidden, C receive capacity

Where no symmetric heap spans the group (several hosts on CPU, GPUs without
NVSHMEM) every movement is a collective of :mod:`moonplan.comm.a2a`: a put
exchanges rows (``exchange_rows``), :meth:`AllToAllRows.fetch_rows` asks each owner
for its rows (``gather_rows``). The buffers are plain local tensors and
:meth:`AllToAllRows.publish` has nothing to do; ``fetch_rows`` is a collective (not
``one_sided``). With the overlapped schedule on the CPU the runtime's worker thread
fetches weight rows (prefetch, replica-gradient reduce) through
``on_group(background)`` (:meth:`~moonplan.runtime.transports.moves.RowMoves.on_group`):
these same movements on a second process group over the same ranks, never on the
group of the data path, which the caller keeps using meanwhile; on CUDA they run
inline (:func:`~moonplan.runtime.background.lane_kind`). :class:`AllToAllTransport`
sends one row per record, :class:`AllToAllTokenTransport` one per ``(token,
destination rank)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moonplan.comm import a2a
from moonplan.runtime.transports.base import SharedRows
from moonplan.runtime.transports.moves import Put, RowMoves
from moonplan.runtime.transports.records import RecordTransport
from moonplan.runtime.transports.tokens import TokenTransport


@dataclass
class LocalRows:
    """A shared buffer of the all-to-all transport: this rank's tensor, served on request."""

    local: torch.Tensor


class AllToAllRows(RowMoves):
    """The row movements of ``torch.distributed`` all-to-alls."""

    one_sided = False

    def publish(self) -> None:
        """Nothing to publish: all-to-alls carry the rows themselves."""

    def put_rows(self, puts: Sequence[Put]) -> None:
        """Collective: one ``exchange_rows`` per put (see :class:`RowMoves`)."""
        for p in puts:
            flat = _flat(p.buffer.local)
            x_XL = p.rows.reshape(p.rows.shape[0], flat.shape[1])
            if p.top_k != 1:
                x_XL = x_XL[torch.arange(p.dest.numel(), device=x_XL.device) // p.top_k]
            a2a.exchange_rows(self.group, x_XL, p.dest, p.off, flat, check=False)

    def alloc_shared(self, shape: Sequence[int], dtype: torch.dtype) -> LocalRows:
        """A zeroed local tensor (peers get its rows through :meth:`fetch_rows`)."""
        return LocalRows(torch.zeros(*shape, dtype=dtype, device=self.group.device))

    def fetch_rows(
        self, buffer: SharedRows, src_rank_N: Tensor, src_row_N: Tensor, *, check: bool = True
    ) -> Tensor:
        """Collective: ``[n, ...]`` rows of other ranks' ``buffer`` (every rank calls it)."""
        local = buffer.local
        got = a2a.gather_rows(self.group, _flat(local), src_rank_N, src_row_N, check=check)
        return got.view(-1, *local.shape[1:])


def _flat(local: torch.Tensor) -> torch.Tensor:
    """``[C, L]`` view of a buffer's rows (also with ``C = 0``)."""
    return local.view(local.shape[0], math.prod(local.shape[1:]))


class AllToAllTransport(AllToAllRows, RecordTransport):
    """Per-record transport over all-to-alls (see the module docstring)."""


class AllToAllTokenTransport(AllToAllRows, TokenTransport):
    """Token-once transport over all-to-alls (see the module docstring)."""
