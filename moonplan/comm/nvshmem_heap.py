"""``nvshmem`` symmetric heap: CUDA devices sharing NVSHMEM symmetric memory (nvshmem4py).

Legend:
    R  ranks in the group (= NVSHMEM PEs)       Y  heap bytes per rank

Written against the nvshmem4py documentation (``nvshmem.core``: ``get_unique_id``,
``init(..., initializer_method="uid")``, ``tensor``, ``get_peer_tensor``,
``free_tensor``). Ran at one PE on an H200 (2026-12-04: a layer step equals the ipc
heap's bit for bit); several PEs not yet. The ``gpu``-marked test runs it.

Creation (collective, :meth:`NvshmemHeap.open`):

1. NVSHMEM is initialised once per process from the torch process group: rank 0's
   unique id is all-gathered through the group and every rank calls
   ``nvshmem.core.init(device, uid, rank, nranks, initializer_method="uid")``
   (PE ``r`` is group rank ``r``). NVSHMEM is process-global: a later heap must
   use a group with the same ranks;
2. one symmetric buffer of ``Y`` bytes (``nvshmem.core.tensor``, uint8);
3. every peer's copy is exposed as a CUDA tensor through
   ``nvshmem.core.get_peer_tensor`` (NVSHMEM's peer pointer, ``nvshmem_ptr``),
   which exists only for peers in the same NVLink / P2P domain; otherwise every
   rank raises :class:`HeapUnavailable`.

NVSHMEM's own symmetric heap must hold ``Y`` (``NVSHMEM_SYMMETRIC_SIZE``, default
1 GiB). :meth:`barrier` synchronises this rank's current CUDA stream, then
barriers the group: stores made by earlier kernels (local or peer) are then
visible everywhere. :meth:`close` is collective (``nvshmem_free`` is); the
interpreter-exit hook skips the free (it could hang if a peer is gone) and leaves
it to process teardown. NVSHMEM itself is not finalised.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch

from moonplan.comm.errors import HeapUnavailable
from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap

_UID_MAX_BYTES = 1024
# nvshmem.core.InitStatus: 0 not, 1 bootstrapped, 2 initialised, 3 and 4 initialised with
# several PEs per GPU (limited / full MPG), 0x7FFF invalid (nvshmem4py 0.4.1's bindings)
_STATUS_INITIALIZED = (2, 3, 4)


def available() -> tuple[bool, str]:
    """Capability check at call time: ``(True, "")`` or ``(False, reason)``.

    Needs a CUDA device and importable ``nvshmem.core`` and ``cuda.core``.
    """
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    try:
        importlib.import_module("nvshmem.core")
    except Exception as exc:  # ImportError, or a missing shared library
        return False, f"nvshmem4py is not importable ({exc}); pip install nvshmem4py-cu13 (-cu12)"
    try:
        _cuda_device_class()
    except Exception as exc:
        return False, f"cuda.core is not importable ({exc}); pip install cuda-python"
    return True, ""


def _cuda_device_class() -> Any:
    try:
        return importlib.import_module("cuda.core").Device
    except (ImportError, AttributeError):
        return importlib.import_module("cuda.core.experimental").Device


class NvshmemHeap(SymmetricHeap):
    """Symmetric heap in NVSHMEM memory (see the module docstring)."""

    backend = "nvshmem"

    def __init__(self, group: EPGroup, nbytes: int, bytes_R: list[torch.Tensor], raw: Any):
        super().__init__(group, nbytes, bytes_R)
        self._raw = raw  # the nvshmem-allocated local tensor (what free_tensor needs)

    @classmethod
    def open(cls, group: EPGroup, nbytes: int) -> NvshmemHeap:
        """Collective: initialise NVSHMEM if needed, allocate ``nbytes``, map the peers.

        Raises:
            HeapUnavailable: no CUDA, no nvshmem4py, a non-CUDA group device, or peers
                without a direct (NVLink/P2P) mapping; raised before any collective
                when the cause is local and visible to every rank alike.
        """
        ok, why = available()
        if not ok:
            raise HeapUnavailable(f"nvshmem heap unavailable: {why}")
        if group.device.type != "cuda":
            raise HeapUnavailable(f"nvshmem heap needs a CUDA group device, got {group.device}")
        nvshmem = importlib.import_module("nvshmem.core")
        _init_once(nvshmem, group)
        torch.cuda.synchronize(group.device)
        raw = nvshmem.tensor((max(nbytes, 1),), dtype=torch.uint8)  # collective
        bytes_R, err = _peer_views(nvshmem, raw, group)
        try:
            group.agree(not err, err, what="nvshmem heap: peer mapping")
        except Exception as exc:
            nvshmem.free_tensor(raw)  # collective: every rank gets here
            raise HeapUnavailable(str(exc)) from exc
        return cls(group, nbytes, [b[:nbytes] for b in bytes_R], raw)

    def barrier(self) -> None:
        """Collective: finish this rank's queued CUDA work, then barrier the group."""
        torch.cuda.current_stream(self.group.device).synchronize()
        self.group.barrier()

    def _release(self, collective: bool) -> None:
        self._bytes_R = []
        if collective and self._raw is not None:
            torch.cuda.synchronize(self.group.device)
            importlib.import_module("nvshmem.core").free_tensor(self._raw)
        self._raw = None


def _init_once(nvshmem: Any, group: EPGroup) -> None:
    """Initialise NVSHMEM from ``group`` unless it already is (then check it matches)."""
    if _is_initialized(nvshmem):
        if nvshmem.my_pe() != group.rank or nvshmem.n_pes() != group.size:
            raise HeapUnavailable(
                f"NVSHMEM is already initialised as PE {nvshmem.my_pe()} of "
                f"{nvshmem.n_pes()}; this group is rank {group.rank} of {group.size}"
            )
        return
    device_class = _cuda_device_class()
    dev = device_class(group.device.index or 0)
    dev.set_current()
    uid = nvshmem.get_unique_id(empty=group.rank != 0)
    uid_bytes = uid._data.view("uint8")
    if uid_bytes.nbytes > _UID_MAX_BYTES:
        raise HeapUnavailable(f"NVSHMEM unique id of {uid_bytes.nbytes} bytes is unexpected")
    rows = group.all_gather_bytes(uid_bytes.tobytes(), _UID_MAX_BYTES)
    uid_bytes[:] = np.frombuffer(rows[0], dtype=np.uint8)
    nvshmem.init(device=dev, uid=uid, rank=group.rank, nranks=group.size, initializer_method="uid")


def _is_initialized(nvshmem: Any) -> bool:
    status = nvshmem.init_status()
    return int(getattr(status, "value", status)) in _STATUS_INITIALIZED


def _peer_views(nvshmem: Any, raw: torch.Tensor, group: EPGroup) -> tuple[list[torch.Tensor], str]:
    """``[Y]`` uint8 CUDA view of every rank's buffer, or ``([], error)``."""
    views = []
    for r in range(group.size):
        if r == group.rank:
            views.append(raw)
            continue
        try:
            peer = nvshmem.get_peer_tensor(raw, r)
        except Exception as exc:
            return [], f"no direct mapping of PE {r}'s memory: {exc}"
        if peer is None or peer.data_ptr() == 0:
            return [], f"no direct mapping of PE {r}'s memory (not in this NVLink/P2P domain)"
        views.append(peer)
    return views, ""
