"""The nvshmem heap: clean import and clear errors without a GPU; a GPU check with one.

The GPU check starts real NCCL ranks as fresh interpreters (a forked child cannot
use CUDA once the parent has touched it).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moonplan.comm import EPGroup, HeapUnavailable, create_heap
from moonplan.comm.nvshmem_heap import NvshmemHeap, available

WORKER = Path(__file__).with_name("nvshmem_worker.py")


def test_available_is_a_reasoned_capability_check():
    ok, why = available()
    assert isinstance(ok, bool) and isinstance(why, str)
    assert ok or why


@pytest.mark.skipif(available()[0], reason="nvshmem is usable here")
def test_unavailable_raises_a_clear_error():
    with pytest.raises(HeapUnavailable, match="nvshmem heap unavailable"):
        NvshmemHeap.open(EPGroup(), 1024)
    with pytest.raises(HeapUnavailable, match=r"rank 0: .+"):
        create_heap(EPGroup(), 1024, backend="nvshmem")


def test_init_status_reading():
    """Initialised: 2, and 3 or 4 (several PEs per GPU); not: 0, 1, and 0x7FFF (invalid)."""
    from types import SimpleNamespace

    from moonplan.comm.nvshmem_heap import _is_initialized

    def status(v):
        return SimpleNamespace(init_status=lambda: SimpleNamespace(value=v))

    assert [_is_initialized(status(v)) for v in (0, 1, 2, 3, 4, 0x7FFF)] == [
        False, False, True, True, True, False
    ]  # fmt: skip
    assert _is_initialized(SimpleNamespace(init_status=lambda: 2))  # a plain int too


@pytest.mark.gpu
def test_peer_writes_on_gpus():
    ok, why = available()
    if not ok:
        pytest.skip(why)
    world = min(torch.cuda.device_count(), 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER)],
            env=dict(
                os.environ,
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and "OK" in out, f"rank {r}:\n{out}"
