"""Symmetric heap: the same allocations on every rank, each with a view of every peer's copy.

Legend:
    R  ranks in the group       Y  heap bytes per rank (``nbytes``)

Every rank maps a byte buffer ``[Y]`` of every rank (its own and its peers').
:meth:`SymmetricHeap.alloc` is a bump allocator (256-byte aligned) that cuts the
same ``[offset, offset + size)`` range out of every buffer, so one allocation is
a :class:`SymTensor`: ``.local`` (this rank's copy) and ``.peer(r)`` (rank ``r``'s
copy, writable; a write is visible to ``r`` after :meth:`SymmetricHeap.barrier`).

Backends (``moonplan.comm.heap_factory.create_heap(group, nbytes, backend=...)``, which
documents ``"auto"``):

* ``"shm"``: CPU processes on one host, files in ``/dev/shm`` (``shm_heap``);
* ``"nvshmem"``: CUDA devices through nvshmem4py (``nvshmem_heap``);
* ``"ipc"``: CUDA processes on one host mapping each other's memory (``ipc_heap``).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import weakref
from collections.abc import Sequence

import torch

from moonplan.comm.errors import ContractError, HeapUnavailable
from moonplan.comm.group import EPGroup

__all__ = ["ALIGN", "ContractError", "HeapUnavailable", "SymTensor", "SymmetricHeap"]

ALIGN = 256  # byte alignment of every allocation


class SymTensor:
    """One symmetric allocation: the same ``shape``/``dtype`` at the same heap offset on
    every rank.

    Attributes:
        offset: byte offset inside the heap (a multiple of 256).
        nbytes: bytes of the allocation.
    """

    def __init__(self, views_R: Sequence[torch.Tensor], rank: int, offset: int, nbytes: int):
        self._views_R = list(views_R)
        self._rank = rank
        self.offset = offset
        self.nbytes = nbytes

    @property
    def local(self) -> torch.Tensor:
        """This rank's copy (writable)."""
        return self._views_R[self._rank]

    def peer(self, r: int) -> torch.Tensor:
        """Rank ``r``'s copy (writable shared memory; ``peer(rank)`` is ``local``)."""
        if not 0 <= r < len(self._views_R):
            raise IndexError(f"peer rank {r} out of range [0, {len(self._views_R)})")
        return self._views_R[r]

    def peer_ptrs(self) -> torch.Tensor:
        """``[R]`` int64 address of every rank's copy in this process (for peer-pointer
        kernels: a table of addresses cast to pointers inside the kernel)."""
        return torch.tensor([v.data_ptr() for v in self._views_R], dtype=torch.int64)

    @property
    def shape(self) -> torch.Size:
        return self.local.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def __repr__(self) -> str:
        return f"SymTensor(shape={tuple(self.shape)}, dtype={self.dtype}, offset={self.offset})"


class SymmetricHeap:
    """A symmetric heap of ``nbytes`` per rank (build it with :meth:`create`).

    Subclasses provide the mapped byte buffers and :meth:`_release`.

    Attributes:
        group: the :class:`EPGroup` it spans.
        nbytes: ``Y``, bytes per rank.
        backend: ``"shm"``, ``"nvshmem"`` or ``"ipc"``.
    """

    backend = "base"

    def __init__(self, group: EPGroup, nbytes: int, bytes_R: Sequence[torch.Tensor]):
        self.group = group
        self.nbytes = nbytes
        self._bytes_R: list[torch.Tensor] = list(bytes_R)
        self._used = 0
        self._count = 0
        self._digest = hashlib.blake2b(digest_size=16)
        self._closed = False
        self._pid = os.getpid()
        atexit.register(_close_at_exit, weakref.ref(self))

    # ---- allocation -------------------------------------------------------------------
    def alloc(self, shape: Sequence[int] | int, dtype: torch.dtype) -> SymTensor:
        """Allocate ``shape``/``dtype`` at the next 256-byte aligned offset (local, no
        communication). Every rank must make the same allocations in the same order;
        :meth:`check_consistent` verifies it.

        Raises:
            MemoryError: the heap is full (message with the sizes).
            RuntimeError: the heap is closed.
        """
        if self._closed:
            raise RuntimeError(f"{self.backend} heap is closed")
        shape_t = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape_t):
            raise ValueError(f"negative dimension in shape {shape_t}")
        size = _numel(shape_t) * torch.empty((), dtype=dtype).element_size()
        offset = -(-self._used // ALIGN) * ALIGN
        if offset + size > self.nbytes:
            raise MemoryError(
                f"{self.backend} heap full: allocation {shape_t} {dtype} needs {size} bytes at "
                f"offset {offset}, heap has {self.nbytes} bytes ({self._used} used)"
            )
        views_R = [b[offset : offset + size].view(dtype).view(shape_t) for b in self._bytes_R]
        self._used = offset + size
        self._count += 1
        self._digest.update(f"{shape_t}:{dtype};".encode())
        return SymTensor(views_R, self.group.rank, offset, size)

    def check_consistent(self) -> None:
        """Collective: raise :class:`ContractError` on every rank unless every rank made the
        same allocations (shapes, dtypes, order) so far."""
        summary = f"{self._count} allocations, {self._used} bytes, hash {self._digest.hexdigest()}"
        self.group.check_same("symmetric heap allocations", summary)

    @property
    def used(self) -> int:
        """Bytes allocated so far (the end of the last allocation)."""
        return self._used

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- synchronisation and teardown -------------------------------------------------
    def barrier(self) -> None:
        """Collective: every write made before it (to local or peer views) is visible to
        every rank after it."""
        self.group.barrier()

    def close(self) -> None:
        """Release the heap (idempotent). Views handed out must no longer be used.

        In a forked child (another process id than the creator) it only drops references.
        """
        self._close(collective=True)

    def _close_at_exit(self) -> None:
        self._close(collective=False)

    def _close(self, collective: bool) -> None:
        """Close once; release the backend only in the creating process."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            self._release(collective=collective)
        self._bytes_R = []

    def _release(self, collective: bool) -> None:
        """Free the backend's resources; ``collective=False`` at interpreter exit."""

    def __enter__(self) -> SymmetricHeap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_at_exit(ref: weakref.ref) -> None:
    heap = ref()
    if heap is not None:
        heap._close_at_exit()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
