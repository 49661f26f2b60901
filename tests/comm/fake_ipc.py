"""A fake :class:`~moonplan.comm.ipc_mapper.IpcMapper` over files, for the ``ipc`` heap on CPU.

Legend: R ranks (processes), Y bytes of one buffer.

:class:`FileMapper` plays a device: a buffer is a file in ``directory`` mapped shared
(``torch.from_file``), its handle the file's name, and opening a peer's handle maps
the peer's file, so the ``ipc`` heap's collective code (exchange, agreements, error
paths, close order) runs for real across forked ranks. Like CUDA it refuses to open a
handle of its own process. Injected failures (``fail``) and a peer-access table
(``no_p2p``) drive the error paths; ``log`` records every operation with a
``time.monotonic()`` stamp (one clock for every process of the host), so a test can
check that no buffer was freed before every peer closed its mapping.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from moonplan.comm.ipc_mapper import DeviceBuffer


@dataclass
class FileMapper:
    """Files in ``directory`` as device memory (see the module docstring).

    Attributes:
        directory: where buffers live (shared by the ranks).
        device_id: this process's "device" (equal ids: ranks sharing a device).
        no_p2p: peer device ids this process cannot map.
        fail: steps that fail here: ``"identity"``, ``"allocate"``, ``"open"``,
            ``"long-handle"``.
        log: ``(operation, buffer name, time.monotonic())`` of every operation.
    """

    directory: str
    device_id: str = "dev0"
    no_p2p: frozenset[str] = frozenset()
    fail: frozenset[str] = frozenset()
    log: list[tuple[str, str, float]] = field(default_factory=list)
    name: str = "fake-ipc"

    def identity(self, device: torch.device) -> tuple[str, str]:
        if "identity" in self.fail:
            return self.device_id, "injected: no driver"
        return self.device_id, ""

    def peer_access(self, device: torch.device, peer_id: str) -> str:
        return f"no P2P from {self.device_id} to {peer_id}" if peer_id in self.no_p2p else ""

    def allocate(self, device: torch.device, nbytes: int) -> tuple[DeviceBuffer, bytes]:
        if "allocate" in self.fail:
            raise MemoryError("injected: out of memory")
        name = f"buf-{os.getpid()}-{len(self.log)}"
        path = os.path.join(self.directory, name)
        with open(path, "wb") as f:
            f.truncate(max(nbytes, 1))
        buf = self._map(name, nbytes)
        self._note("allocate", name)
        handle = name.encode() + (b"#" * 80 if "long-handle" in self.fail else b"")
        return buf, handle

    def open(self, device: torch.device, handle: bytes, nbytes: int) -> DeviceBuffer:
        name = handle.decode()
        if "open" in self.fail:
            raise RuntimeError("injected: cudaErrorMapBufferObjectFailed")
        if name.startswith(f"buf-{os.getpid()}-"):
            raise RuntimeError("a process cannot open its own handle")
        buf = self._map(name, nbytes)
        self._note("open", name)
        return buf

    def close(self, buf: DeviceBuffer) -> None:
        self._note("close", buf.name)

    def free(self, buf: DeviceBuffer) -> None:
        os.unlink(os.path.join(self.directory, buf.name))
        self._note("free", buf.name)

    def files(self) -> list[str]:
        """The buffers' files still in the directory."""
        return sorted(n for n in os.listdir(self.directory) if n.startswith("buf-"))

    def _map(self, name: str, nbytes: int) -> DeviceBuffer:
        path = os.path.join(self.directory, name)
        t = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        return DeviceBuffer(t.data_ptr(), nbytes, t, name=name)

    def _note(self, op: str, name: str) -> None:
        self.log.append((op, name, time.monotonic()))
