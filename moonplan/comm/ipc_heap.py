"""``ipc`` symmetric heap: processes on one host map each other's device memory (CUDA IPC).

Legend:
    R  ranks in the group       Y  heap bytes per rank

Each rank allocates one buffer of ``Y`` bytes on its device, and every rank maps every
peer's buffer, so ``SymTensor.peer(r)`` is rank ``r``'s memory seen from this process:
the Triton dispatch, combine and prefetch kernels store into it and load from it
directly. Several ranks may share one GPU (how the tests run on one device; each
process maps the others' memory) or sit on GPUs of one NVLink/P2P domain (production),
through the same code. The device operations are an :class:`~moonplan.comm.ipc_mapper.IpcMapper`
(CUDA: :class:`~moonplan.comm.ipc_mapper.CudaIpcMapper`); :func:`set_mapper` swaps in
another (the CPU tests' fake, which runs this file's collective logic for real).

Creation (collective, :meth:`IpcHeap.open`; ``device_ids`` from ``create_heap``'s survey):

1. every rank checks it can map every peer's device (same device, or P2P between the
   two); any rank that cannot makes every rank raise :class:`HeapUnavailable`, naming
   each pair and the reason, before anything is allocated;
2. every rank allocates its buffer and exports its handle; a failure anywhere (out of
   memory) raises the same :class:`ContractError` on every rank, after the ranks that
   did allocate freed it;
3. the handles are all-gathered through the process group, and every rank opens
   every peer's; a failure anywhere raises :class:`HeapUnavailable` on every rank (the
   peers cannot map each other), after every rank closed what it opened and, behind a
   barrier (nobody maps it any more), freed its buffer.

:meth:`barrier` finishes this rank's queued device work, then barriers the group:
stores made by earlier kernels (local or peer) are then visible everywhere.
:meth:`close` is collective: a barrier (every rank is done with the views), every rank
closes its mappings, a barrier, every rank frees its buffer (freeing memory a peer
still maps is undefined behaviour in CUDA). The interpreter-exit hook only closes
this process's mappings and leaves its buffer to process teardown (a peer may still
map it, and no collective can run then). A rank that is killed leaves nothing
mapped: the driver releases a dead process's allocations and mappings with its
context; the other ranks fail at their next collective and close theirs at exit.

Ran on an H200 with :class:`CudaIpcMapper` (2026-12-04: 1, 2 and 4 processes on one
GPU; several GPUs not yet); on CPU every step above and every error path runs through
the fake mapper (``tests/comm/test_ipc_heap.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch

from moonplan.comm.errors import ContractError, HeapUnavailable
from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap
from moonplan.comm.ipc_mapper import HANDLE_BYTES, CudaIpcMapper, DeviceBuffer, IpcMapper

__all__ = ["IpcHeap", "get_mapper", "set_mapper"]

_MAPPER: list[IpcMapper] = [CudaIpcMapper()]  # the one the ipc heap uses (set_mapper)


def get_mapper() -> IpcMapper:
    """The mapper new ``ipc`` heaps use (:class:`CudaIpcMapper` unless :func:`set_mapper`)."""
    return _MAPPER[0]


def set_mapper(mapper: IpcMapper | None) -> None:
    """Use ``mapper`` for new ``ipc`` heaps in this process (``None``: back to CUDA).

    Every rank must set the same kind of mapper (tests, other accelerators)."""
    _MAPPER[0] = CudaIpcMapper() if mapper is None else mapper


class IpcHeap(SymmetricHeap):
    """Symmetric heap of device buffers mapped across processes (see the module docstring).

    Attributes:
        mapper: the :class:`IpcMapper` that made it (``mapper.name``: ``"cuda-ipc"``, ...).
        device_ids: ``[R]`` every rank's device id (equal ids: ranks sharing a device).
    """

    backend = "ipc"

    def __init__(
        self,
        group: EPGroup,
        nbytes: int,
        own: DeviceBuffer,
        peers: dict[int, DeviceBuffer],
        mapper: IpcMapper,
        device_ids: Sequence[str],
    ):
        views = [own.tensor if r == group.rank else peers[r].tensor for r in range(group.size)]
        super().__init__(group, nbytes, [v[:nbytes] for v in views])
        self.mapper, self.device_ids = mapper, list(device_ids)
        self._own: DeviceBuffer | None = own
        self._peers = dict(peers)

    @classmethod
    def open(cls, group: EPGroup, nbytes: int, device_ids: Sequence[str]) -> IpcHeap:
        """Collective: check peer access, allocate, exchange handles, map every peer.

        Args:
            device_ids: ``[R]`` every rank's device id (same list on every rank).

        Raises:
            HeapUnavailable: on every rank, when some rank cannot map some peer.
            ContractError: on every rank, when allocating failed on some rank.
        """
        mapper = get_mapper()
        _agree_or_unavailable(group, _access_error(mapper, group, device_ids), "peer access")
        own, handle, err = _allocate(mapper, group.device, nbytes)
        try:
            group.agree(not err, err, what="ipc heap: allocate")
        except BaseException:
            _free_quietly(mapper, own)
            raise
        assert own is not None
        handles = group.all_gather_bytes(handle, HANDLE_BYTES)
        peers, err = _open_peers(mapper, group, handles, nbytes)
        try:
            _agree_or_unavailable(group, err, "map peers")
        except BaseException:
            _close_quietly(mapper, peers.values())
            with contextlib.suppress(Exception):
                group.barrier()  # every rank closed its mappings: the buffers can go
            _free_quietly(mapper, own)
            raise
        return cls(group, nbytes, own, peers, mapper, device_ids)

    def barrier(self) -> None:
        """Collective: finish this rank's queued device work, then barrier the group."""
        _sync(self.group.device)
        self.group.barrier()

    def _release(self, collective: bool) -> None:
        """Close the peers' mappings; free this rank's buffer only when ``collective``
        (after a barrier: nobody maps it any more)."""
        self._bytes_R = []
        if collective:
            _sync(self.group.device)
            self.group.barrier()  # every rank is done with every view
        else:  # interpreter exit: the device may be gone already
            with contextlib.suppress(Exception):
                _sync(self.group.device)
        peers, self._peers = list(self._peers.values()), {}
        _close_quietly(self.mapper, peers)
        own, self._own = self._own, None
        if collective and own is not None:
            self.group.barrier()  # every rank closed its mappings of this buffer
            self.mapper.free(own)


# ---- creation steps ---------------------------------------------------------------------------
def _access_error(mapper: IpcMapper, group: EPGroup, device_ids: Sequence[str]) -> str:
    """Why this rank cannot map some peer's device (``""``: it can map every one)."""
    bad = []
    for r, peer_id in enumerate(device_ids):
        if r == group.rank:
            continue
        try:
            why = mapper.peer_access(group.device, peer_id)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why:
            bad.append(f"rank {r}: {why}")
    return "; ".join(bad)


def _allocate(
    mapper: IpcMapper, device: torch.device, nbytes: int
) -> tuple[DeviceBuffer | None, bytes, str]:
    """``(buffer, handle, "")`` or ``(None, b"", error)``."""
    try:
        own, handle = mapper.allocate(device, nbytes)
    except (MemoryError, RuntimeError, OSError) as exc:
        return None, b"", f"cannot allocate {nbytes} bytes on {device}: {exc}"
    if len(handle) > HANDLE_BYTES:
        _free_quietly(mapper, own)
        return None, b"", f"{mapper.name} exported a {len(handle)}-byte handle (> {HANDLE_BYTES})"
    return own, handle, ""


def _open_peers(
    mapper: IpcMapper, group: EPGroup, handles: list[bytes], nbytes: int
) -> tuple[dict[int, DeviceBuffer], str]:
    """Every peer's buffer mapped, or what was mapped and the first error."""
    peers: dict[int, DeviceBuffer] = {}
    for r, handle in enumerate(handles):
        if r == group.rank:
            continue
        try:
            peers[r] = mapper.open(group.device, handle, nbytes)
        except Exception as exc:
            return peers, f"cannot map rank {r}'s heap: {type(exc).__name__}: {exc}"
    return peers, ""


def _agree_or_unavailable(group: EPGroup, err: str, what: str) -> None:
    """Collective: :class:`HeapUnavailable` on every rank if ``err`` on any rank."""
    try:
        group.agree(not err, err, what=f"ipc heap: {what}")
    except ContractError as exc:
        raise HeapUnavailable(f"{exc}; use the a2a transport") from exc


def _close_quietly(mapper: IpcMapper, bufs: Iterable[DeviceBuffer]) -> None:
    for buf in list(bufs):
        with contextlib.suppress(Exception):
            mapper.close(buf)


def _free_quietly(mapper: IpcMapper, buf: DeviceBuffer | None) -> None:
    if buf is not None:
        with contextlib.suppress(Exception):
            mapper.free(buf)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
