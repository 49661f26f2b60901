"""Symmetric heap: the same allocations on every rank, each with a view of every peer's copy.

Legend:
    R  ranks in the group       B  heap bytes per rank (``nbytes``)

Every rank maps a byte buffer ``[B]`` of every rank (its own and its peers').
:meth:`SymmetricHeap.alloc` is a bump allocator (256-byte aligned) that cuts the
same ``[offset, offset + size)`` range out of every buffer, so one allocation is
a :class:`SymTensor`: ``.local`` (this rank's copy) and ``.peer(r)`` (rank ``r``'s
copy, writable; a write is visible to ``r`` after :meth:`SymmetricHeap.barrier`).

Backends (``SymmetricHeap.create(group, nbytes, backend=...)``):

* ``"shm"``: CPU processes on one host, files in ``/dev/shm`` (``shm_heap``);
* ``"nvshmem"``: CUDA devices through nvshmem4py (``nvshmem_heap``);
* ``"auto"``: nvshmem when the group's device is CUDA and nvshmem4py is usable on
  every rank; shm when the device is the CPU and every rank runs on the same host;
  otherwise :class:`HeapUnavailable` (with the reason) on every rank, so that the
  caller can switch to the all-to-all transport (``moonplan.comm.a2a``) explicitly.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import secrets
import socket
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from moonplan.comm.errors import ContractError, HeapUnavailable
from moonplan.comm.group import EPGroup
from moonplan.comm.shm_files import SHM_DIR, this_process

__all__ = ["ALIGN", "ContractError", "HeapUnavailable", "SymTensor", "SymmetricHeap"]

ALIGN = 256  # byte alignment of every allocation
BACKENDS = ("auto", "shm", "nvshmem")
_SURVEY_BYTES = 1024


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
        nbytes: ``B``, bytes per rank.
        backend: ``"shm"`` or ``"nvshmem"``.
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

    @classmethod
    def create(cls, group: EPGroup, nbytes: int, *, backend: str = "auto") -> SymmetricHeap:
        """Collective: build a heap of ``nbytes`` per rank over ``group``.

        Args:
            group: the ranks that share the heap.
            nbytes: bytes per rank (``>= 0``), identical on every rank.
            backend: ``"auto"``, ``"shm"`` or ``"nvshmem"`` (identical on every rank).

        Raises:
            HeapUnavailable: on every rank, when the backend cannot span the group.
            ContractError: on every rank, when ``nbytes``/``backend`` differ across ranks
                or creating the heap fails on some rank.
        """
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        survey = _survey(group, backend, nbytes)
        chosen = _choose_backend(group, backend, survey)
        if chosen == "shm":
            from moonplan.comm.shm_files import Owner
            from moonplan.comm.shm_heap import ShmHeap

            owners = [Owner.from_tag(s["owner"]) for s in survey]
            return ShmHeap.open(group, nbytes, token=survey[0]["token"], owners=owners)
        from moonplan.comm.nvshmem_heap import NvshmemHeap

        return NvshmemHeap.open(group, nbytes)

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
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            self._release(collective=True)
        self._bytes_R = []

    def _close_at_exit(self) -> None:
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            self._release(collective=False)
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


# ---- backend choice (one collective: every rank decides from the same survey) -------
def _survey(group: EPGroup, backend: str, nbytes: int) -> list[dict[str, Any]]:
    """Every rank's request and capabilities (one all-gather); checks the request agrees."""
    cuda = group.device.type == "cuda"
    nv_ok, nv_why = _nvshmem_available() if cuda or backend == "nvshmem" else (False, "")
    mine = {
        "backend": backend,
        "nbytes": nbytes,
        "host": socket.gethostname(),
        "cuda": cuda,
        "shm": _shm_usable(),
        "owner": this_process().tag(),
        "nvshmem": nv_ok,
        "why": nv_why[:300],
        "token": secrets.token_hex(8),
    }
    rows = group.all_gather_bytes(json.dumps(mine).encode(), _SURVEY_BYTES)
    survey = [json.loads(row) for row in rows]
    for key in ("backend", "nbytes"):
        values = [s[key] for s in survey]
        if len(set(values)) > 1:
            bad = tuple(r for r, v in enumerate(values) if v != values[0])
            raise ContractError(f"SymmetricHeap.create: {key} differs across ranks: {values}", bad)
    return survey


def _shm_usable() -> bool:
    """``/dev/shm`` is a writable directory and ``/proc/self/fd`` reopens descriptors."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) and os.path.isdir("/proc/self/fd")


def _nvshmem_available() -> tuple[bool, str]:
    from moonplan.comm.nvshmem_heap import available

    return available()


def _choose_backend(group: EPGroup, backend: str, survey: list[dict[str, Any]]) -> str:
    if backend == "auto":
        backend = "nvshmem" if any(s["cuda"] for s in survey) else "shm"
    if backend == "nvshmem":
        bad = [(r, s["why"]) for r, s in enumerate(survey) if not s["nvshmem"]]
        if bad:
            reasons = "; ".join(f"rank {r}: {why}" for r, why in bad)
            raise HeapUnavailable(f"nvshmem heap unavailable ({reasons}); use the a2a transport")
        return backend
    hosts: dict[str, list[int]] = {}
    for r, s in enumerate(survey):
        hosts.setdefault(s["host"], []).append(r)
    if len(hosts) > 1:
        raise HeapUnavailable(
            f"shm heap needs every rank on one host; the group spans {len(hosts)} hosts "
            f"{hosts}; use the a2a transport"
        )
    no_shm = [r for r, s in enumerate(survey) if not s["shm"]]
    if no_shm:
        raise HeapUnavailable(
            f"shm heap: /dev/shm is not a writable directory (or /proc/self/fd is missing) "
            f"on rank {no_shm}; use the a2a transport"
        )
    return backend
