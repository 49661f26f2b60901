"""How the ``ipc`` heap allocates, exports and maps device memory: a small typed interface.

Legend:
    Y  bytes of one buffer (a rank's heap)

:class:`IpcMapper` is everything :mod:`moonplan.comm.ipc_heap` asks of a device: who
the device is, whether it can map a peer device's memory, and the five memory
operations (allocate, export a handle, open a peer's handle, close it, free). The
heap's collective logic (the exchange, the agreements, the error paths, the close
order) is written once against it; :class:`CudaIpcMapper` is the CUDA one, and tests
on the CPU inject a fake (``tests/comm/fake_ipc.py``) that runs the same collective
code over files.

:class:`CudaIpcMapper` uses the CUDA runtime through cuda-python (``cuda.bindings.runtime``):
``cudaMalloc`` (a dedicated allocation, so its handle maps exactly this buffer, offset
0), ``cudaIpcGetMemHandle`` (64 bytes), ``cudaIpcOpenMemHandle`` with
``cudaIpcMemLazyEnablePeerAccess``, ``cudaIpcCloseMemHandle``, ``cudaFree``, and
``cudaDeviceCanAccessPeer`` for the P2P check. Its memory reaches torch as a ``uint8``
tensor through ``__cuda_array_interface__`` (``torch.as_tensor``): the tensor does not
own the memory; the heap frees it. Rules from the CUDA runtime documentation that the
heap follows: a handle is opened by another process only (never by its exporter);
memory must not be freed before every importer has closed its mapping (undefined
behaviour otherwise), so the heap's close is collective: close, barrier, free.

Ran on an H200 (2026-12-04, processes sharing one GPU): written against the
cuda-python 13 bindings (checked on CPU: the handle struct's 64 bytes round-trip
through ``getPtr()``), the error paths run on CPU through the fake mapper;
``tests/comm/test_ipc_heap.py``'s ``gpu`` tests run it.
"""

from __future__ import annotations

import ctypes
import importlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

HANDLE_BYTES = 64  # the largest handle a mapper may export (cudaIpcMemHandle_t: 64 bytes)


@dataclass(frozen=True)
class DeviceBuffer:
    """Device memory seen by this process: its address, size and a ``[Y]`` uint8 tensor.

    Attributes:
        ptr: the address in this process (``tensor.data_ptr()``).
        nbytes: ``Y``.
        tensor: ``[Y]`` uint8 on the device; it does not own the memory.
        name: what the mapper needs to close or free it (its handle, a path, ...).
    """

    ptr: int
    nbytes: int
    tensor: torch.Tensor
    name: str = ""


class IpcMapper(Protocol):
    """The device operations of the ``ipc`` heap (see the module docstring).

    Every method raises ``RuntimeError`` (or ``MemoryError`` for :meth:`allocate`) with
    a readable message on failure; the heap turns that into the same error on every rank.
    """

    name: str

    def identity(self, device: torch.device) -> tuple[str, str]:
        """``(device id, why not)``: ``why not`` is ``""`` where this mapper can serve
        ``device``. The id (``""`` if unknown) names the physical device the same way in
        every process of the host, also where ``why not`` is set (ranks sharing a device
        are told apart from ranks on devices of their own by it)."""
        ...

    def peer_access(self, device: torch.device, peer_id: str) -> str:
        """``""`` if ``device`` can map memory of the device ``peer_id``, else why not."""
        ...

    def allocate(self, device: torch.device, nbytes: int) -> tuple[DeviceBuffer, bytes]:
        """A new buffer of ``nbytes`` (zeroed) and its handle (at most ``HANDLE_BYTES``)."""
        ...

    def open(self, device: torch.device, handle: bytes, nbytes: int) -> DeviceBuffer:
        """Map a peer's buffer from its handle (never this process's own handle)."""
        ...

    def close(self, buf: DeviceBuffer) -> None:
        """Unmap a buffer :meth:`open` returned."""
        ...

    def free(self, buf: DeviceBuffer) -> None:
        """Free a buffer :meth:`allocate` returned (after every peer closed its mapping)."""
        ...


class _CudaBytes:
    """``__cuda_array_interface__`` (version 2: no stream to synchronise with; the heap's
    barriers order the accesses) of ``nbytes`` bytes at ``ptr``: what ``torch.as_tensor``
    wraps without copying (the tensor keeps this object alive)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
            "strides": None,
        }


class CudaIpcMapper:
    """The :class:`IpcMapper` of CUDA devices (cuda-python runtime; module docstring)."""

    name = "cuda-ipc"

    def identity(self, device: torch.device) -> tuple[str, str]:
        if device.type != "cuda":
            return "", f"the ipc heap maps CUDA memory; the group's device is {device}"
        if not torch.cuda.is_available():
            return "", "CUDA is not available"
        uuid = _uuid(device.index or 0)
        try:
            _runtime()
        except ImportError as exc:
            return uuid, f"cuda-python is not importable ({exc}); pip install 'cuda-python>=12.6'"
        return uuid, ""

    def peer_access(self, device: torch.device, peer_id: str) -> str:
        mine = device.index or 0
        if _uuid(mine) == peer_id:
            return ""  # the same GPU: other processes map it without P2P
        peers = [i for i in range(torch.cuda.device_count()) if _uuid(i) == peer_id]
        if not peers:  # not visible here (CUDA_VISIBLE_DEVICES): opening the handle tells
            return ""
        can = _check(_runtime().cudaDeviceCanAccessPeer(mine, peers[0]), "cudaDeviceCanAccessPeer")
        if not can:
            return f"GPU {mine} cannot access GPU {peers[0]} ({peer_id}): no P2P between them"
        return ""

    def allocate(self, device: torch.device, nbytes: int) -> tuple[DeviceBuffer, bytes]:
        rt = _runtime()
        _set_device(device)
        size = max(nbytes, 1)  # cudaMalloc(0) gives no address to export
        err, ptr = rt.cudaMalloc(size)
        if int(err):
            raise MemoryError(f"cudaMalloc({size}) on {device} failed: {_name(err)}")
        ptr = int(ptr)
        try:
            handle = _check(rt.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
            _check(rt.cudaMemset(ptr, 0, size), "cudaMemset")
            _check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            raw = ctypes.string_at(handle.getPtr(), HANDLE_BYTES)
            buf = DeviceBuffer(ptr, nbytes, _tensor(ptr, nbytes, device), name=raw.hex()[:16])
        except BaseException:
            rt.cudaFree(ptr)
            raise
        return buf, raw

    def open(self, device: torch.device, handle: bytes, nbytes: int) -> DeviceBuffer:
        rt = _runtime()
        _set_device(device)
        h = rt.cudaIpcMemHandle_t()
        ctypes.memmove(h.getPtr(), bytes(handle).ljust(HANDLE_BYTES, b"\0"), HANDLE_BYTES)
        flags = rt.cudaIpcMemLazyEnablePeerAccess
        ptr = int(_check(rt.cudaIpcOpenMemHandle(h, flags), "cudaIpcOpenMemHandle"))
        try:
            return DeviceBuffer(ptr, nbytes, _tensor(ptr, nbytes, device), name=handle.hex()[:16])
        except BaseException:
            rt.cudaIpcCloseMemHandle(ptr)
            raise

    def close(self, buf: DeviceBuffer) -> None:
        _set_device(buf.tensor.device)
        _check(_runtime().cudaIpcCloseMemHandle(buf.ptr), "cudaIpcCloseMemHandle")

    def free(self, buf: DeviceBuffer) -> None:
        _set_device(buf.tensor.device)
        _check(_runtime().cudaFree(buf.ptr), "cudaFree")


# ---- cuda-python helpers --------------------------------------------------------------------
def _runtime() -> Any:
    """``cuda.bindings.runtime`` (cuda-python >= 12.6), or ``cuda.cudart`` (older)."""
    try:
        return importlib.import_module("cuda.bindings.runtime")
    except ImportError:
        return importlib.import_module("cuda.cudart")


def _name(err: Any) -> str:
    return str(getattr(err, "name", err))


def _check(result: Any, what: str) -> Any:
    """The value of a cuda-python ``(err, value)`` or ``(err,)`` result; raises on error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err):
        raise RuntimeError(f"{what} failed: {_name(err)}")
    return rest[0] if rest else None


def _set_device(device: torch.device) -> None:
    """Make ``device`` current for cuda-python's runtime and for torch."""
    index = device.index or 0
    torch.cuda.set_device(index)
    _check(_runtime().cudaSetDevice(index), "cudaSetDevice")


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """``[nbytes]`` uint8 CUDA tensor over ``ptr`` (not owning it); checks its device."""
    t = torch.as_tensor(_CudaBytes(ptr, nbytes), device=device)
    if t.data_ptr() != ptr or t.device != torch.device("cuda", device.index or 0):
        raise RuntimeError(f"wrapping {ptr:#x} gave a tensor at {t.data_ptr():#x} on {t.device}")
    return t
