"""Moving records to their executing rank and back: over a symmetric heap or an all-to-all.

Legend:
    R ranks, S tokens of this rank, K top-k, N = S*K records, H hidden,
    C receive capacity (rows of the expert-grouped receive buffer, padding included)

Both transports have the same contract:

* ``dispatch(x_SH, route, plan)`` writes record ``n`` (token ``n // K``) into row
  ``route.dest_offset`` of rank ``route.dest_rank``'s receive buffer and returns a
  :class:`RecvView` of this rank's buffer (zero copy on the heap: the experts
  read the rows where peers wrote them). Padding rows are zeros.
* ``gather(route)`` reads each record's expert output back from the executing
  rank's output buffer (``o [S, K, H]``); :func:`weighted_sum` then combines
  ``weight * row`` over ``k`` in fp32, in ascending ``k`` (bit-identical run to
  run, and the same on both transports).

``HeapTransport`` writes and reads peers' memory directly (``shm`` on CPU,
``nvshmem`` on GPU); ``AllToAllTransport`` moves the same bytes with
``torch.distributed`` all-to-alls where no heap spans the group (several hosts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moonplan.comm import a2a
from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap, SymTensor
from moonplan.plan.plan_type import Plan
from moonplan.plan.route import Route
from moonplan.runtime.movers import movers


class StaleViewError(RuntimeError):
    """A receive view was used after a later dispatch overwrote its buffer."""


@dataclass
class RecvView:
    """This rank's expert-grouped receive rows of one dispatch (valid until the next)."""

    _tensor: torch.Tensor
    generation: int
    _owner: _Buffers = field(repr=False)

    @property
    def tensor(self) -> torch.Tensor:
        """``[rows, H]`` the received rows; raises :class:`StaleViewError` once stale."""
        if self._owner.generation != self.generation:
            raise StaleViewError(
                f"receive view of dispatch {self.generation} used after dispatch "
                f"{self._owner.generation} overwrote the buffer; copy it to keep it"
            )
        return self._tensor


@dataclass
class _Buffers:
    """Receive and expert-output rows of one layer (``[C, H]`` each) and a generation."""

    recv: SymTensor | torch.Tensor
    out: SymTensor | torch.Tensor
    generation: int = 0


def _zero_padding(recv_CH: torch.Tensor, plan: Plan, rank: int) -> None:
    """Zero the ``align`` padding rows between this rank's rows (experts then see zeros)."""
    if plan.align == 1:
        return
    size = int(plan.recv_size()[rank])
    pos_P = torch.arange(size, device=recv_CH.device)
    w_P = torch.searchsorted(plan.row_offset[rank], pos_P, right=True) - 1
    pad_P = pos_P - plan.row_offset[rank][w_P] >= plan.row_count[rank][w_P]
    recv_CH[:size][pad_P] = 0


def weighted_sum(
    o_SKH: torch.Tensor, weight_SK: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``y[s] = sum_k weight[s, k] * o[s, k]`` in fp32, ``k`` ascending (deterministic)."""
    acc_SH = o_SKH.new_zeros(o_SKH.shape[0], o_SKH.shape[2], dtype=torch.float32)
    w_SK = weight_SK.float()
    for k in range(o_SKH.shape[1]):
        acc_SH += w_SK[:, k, None] * o_SKH[:, k].float()
    return acc_SH.to(out_dtype)


class HeapTransport:
    """Dispatch and gather through a symmetric heap (direct peer stores and loads)."""

    def __init__(
        self, group: EPGroup, heap: SymmetricHeap, capacity: int, hidden: int, dtype: torch.dtype
    ):
        self.group, self.heap, self.capacity = group, heap, capacity
        self.buffers = _Buffers(
            heap.alloc((capacity, hidden), dtype), heap.alloc((capacity, hidden), dtype)
        )

    def publish(self) -> None:
        """Collective: make every rank's writes to its heap buffers visible (a barrier)."""
        self.heap.barrier()

    def _views(self, sym: SymTensor) -> list[torch.Tensor]:
        return [sym.peer(r) for r in range(self.group.size)]

    def out_local(self) -> torch.Tensor:
        """``[C, H]`` this rank's expert-output rows (experts write here, peers read)."""
        return self.buffers.out.local  # type: ignore[union-attr]

    def dispatch(
        self, x_XH: torch.Tensor, route: Route, plan: Plan, per_token: bool = True
    ) -> RecvView:
        """Send rows to their executing ranks: token rows (``x [S, H]``, record ``n`` takes
        token ``n // K``) or record rows (``x [S*K, H]``); collective."""
        K = route.dest_rank.shape[1] if per_token else 1
        self.buffers.generation += 1
        # Nobody writes a peer's rows before that peer is done with its previous view
        # (every rank has reached this dispatch), so a view stays valid until its
        # owner's next dispatch, whatever the peers do meanwhile.
        self.heap.barrier()
        views = self._views(self.buffers.recv)  # type: ignore[arg-type]
        movers(x_XH.device).scatter_rows(
            x_XH, route.dest_rank.reshape(-1), route.dest_offset.reshape(-1), K, views
        )
        self.heap.barrier()  # every peer's rows have landed
        local = self.buffers.recv.local  # type: ignore[union-attr]
        _zero_padding(local, plan, self.group.rank)
        size = int(plan.recv_size()[self.group.rank])
        return RecvView(local[:size], self.buffers.generation, self.buffers)

    def gather(self, route: Route, *, barrier: bool = True) -> torch.Tensor:
        """``o [S, K, H]``: every record's row of its executing rank's output buffer.

        Collective: the barrier publishes the outputs every rank wrote to ``out_local()``.
        ``barrier=False`` when the caller has just called :meth:`publish` itself (the
        overlapped backward publishes the outputs and the staged gradients at once).
        """
        if barrier:
            self.heap.barrier()
        S, K = route.dest_rank.shape
        views = self._views(self.buffers.out)  # type: ignore[arg-type]
        o_NH = torch.empty(S * K, views[0].shape[1], dtype=views[0].dtype, device=views[0].device)
        dest_N, off_N = route.dest_rank.reshape(-1), route.dest_offset.reshape(-1)
        movers(o_NH.device).gather_rows(views, dest_N, off_N, o_NH)
        return o_NH.view(S, K, o_NH.shape[1])


class AllToAllTransport:
    """The same contract over ``torch.distributed`` all-to-alls (no shared memory)."""

    def __init__(self, group: EPGroup, capacity: int, hidden: int, dtype: torch.dtype):
        self.group, self.capacity = group, capacity
        dev = group.device
        self.buffers = _Buffers(
            torch.zeros(capacity, hidden, dtype=dtype, device=dev),
            torch.zeros(capacity, hidden, dtype=dtype, device=dev),
        )

    def out_local(self) -> torch.Tensor:
        return self.buffers.out  # type: ignore[return-value]

    def publish(self) -> None:
        """Nothing to publish: all-to-alls carry the rows themselves."""

    def dispatch(
        self, x_XH: torch.Tensor, route: Route, plan: Plan, per_token: bool = True
    ) -> RecvView:
        K = route.dest_rank.shape[1] if per_token else 1
        self.buffers.generation += 1
        recv: torch.Tensor = self.buffers.recv  # type: ignore[assignment]
        n_N = torch.arange(route.dest_rank.numel(), device=x_XH.device) // K
        dest_N, off_N = route.dest_rank.reshape(-1), route.dest_offset.reshape(-1)
        a2a.exchange_rows(self.group, x_XH[n_N], dest_N, off_N, recv)
        _zero_padding(recv, plan, self.group.rank)
        size = int(plan.recv_size()[self.group.rank])
        return RecvView(recv[:size], self.buffers.generation, self.buffers)

    def gather(self, route: Route, *, barrier: bool = True) -> torch.Tensor:
        """As :meth:`HeapTransport.gather` (``barrier`` has no effect: an all-to-all)."""
        S, K = route.dest_rank.shape
        out: torch.Tensor = self.buffers.out  # type: ignore[assignment]
        o_NH = a2a.gather_rows(
            self.group, out, route.dest_rank.reshape(-1), route.dest_offset.reshape(-1)
        )
        return o_NH.view(S, K, out.shape[1])
