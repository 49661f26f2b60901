"""The shm symmetric heap: allocation, peer writes across 1..4 ranks, and nothing left in
/dev/shm (after close, after errors, after a rank is killed)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from moonplan.comm import ContractError, EPGroup, HeapUnavailable, create_heap
from moonplan.comm.heap import ALIGN
from moonplan.comm.shm_heap import PREFIX, SHM_DIR
from moonplan.testing.dist import run_ranks
from tests.comm.heap_writes import expected_rows, write_to_peers
from tests.comm.killable import join_group, killable_ranks

TIMEOUT = 30.0


def _job_files(token: str) -> list[str]:
    return [name for name in os.listdir(SHM_DIR) if name.startswith(f"{PREFIX}{token}")]


def test_single_rank_alloc_alignment_and_full():
    heap = create_heap(EPGroup(), 2048, backend="auto")
    assert heap.backend == "shm" and _job_files(heap.token) == []
    a = heap.alloc((3, 5), torch.bfloat16)
    b = heap.alloc(7, torch.int64)
    c = heap.alloc((0, 4), torch.float32)
    assert [t.offset for t in (a, b, c)] == [0, ALIGN, 2 * ALIGN]
    assert (a.shape, a.dtype, b.shape, c.shape) == ((3, 5), torch.bfloat16, (7,), (0, 4))
    assert a.peer(0).data_ptr() == a.local.data_ptr()
    assert all(t.local.data_ptr() % ALIGN == 0 for t in (a, b))
    assert torch.count_nonzero(b.local) == 0  # fresh memory is zeroed
    with pytest.raises(MemoryError, match=r"needs 4096 bytes at offset 512, heap has 2048"):
        heap.alloc(1024, torch.float32)
    heap.check_consistent()
    heap.close()
    heap.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        heap.alloc(1, torch.float32)
    with pytest.raises(IndexError):
        a.peer(1)


def test_zero_byte_heap_and_bad_arguments():
    heap = create_heap(EPGroup(), 0, backend="shm")
    assert heap.alloc((0,), torch.float32).shape == (0,)
    with pytest.raises(MemoryError):
        heap.alloc(1, torch.uint8)
    heap.close()
    with pytest.raises(ValueError, match="backend"):
        create_heap(EPGroup(), 16, backend="cuda-ipc")
    with pytest.raises(ValueError, match="nbytes"):
        create_heap(EPGroup(), -1)


def _peer_writes(rank: int, world: int) -> dict:
    heap = create_heap(EPGroup(), 1 << 16, backend="shm")
    left_after_create = _job_files(heap.token)
    out = write_to_peers(heap, rank, world)
    heap.close()
    return {**out, "files": left_after_create + _job_files(heap.token)}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_peer_writes_are_seen_after_barrier(world):
    results = run_ranks(_peer_writes, world, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        assert res["got"] == expected_rows(rank, world)
        assert res["offsets"] == results[0]["offsets"]
        assert all(off % ALIGN == 0 for off in res["offsets"])
        assert res["files"] == []
        assert len(set(res["ptrs"])) == world


def _mismatch(rank: int, world: int, what: str) -> str:
    group = EPGroup()
    try:
        nbytes = 4096 + (256 * rank if what == "nbytes" else 0)
        heap = create_heap(group, nbytes, backend="shm")
        heap.alloc((4, 4) if rank != world - 1 else (4, 5), torch.float32)
        heap.check_consistent()
    except ContractError as exc:
        group.barrier()
        return str(exc)
    return "no error"


@pytest.mark.distributed
@pytest.mark.parametrize("what", ["allocations", "nbytes"])
def test_mismatch_raises_the_same_error_everywhere(what):
    results = run_ranks(_mismatch, 3, what, timeout=TIMEOUT)
    assert len(set(results)) == 1 and results[0] != "no error", results
    assert ("allocations' differs" if what == "allocations" else "nbytes differs") in results[0]


def _two_hosts(rank: int, world: int) -> str:
    import moonplan.comm.heap_factory as heap_mod

    heap_mod.socket.gethostname = lambda: f"host{rank % 2}"  # type: ignore[attr-defined]
    try:
        create_heap(EPGroup(), 4096)
    except HeapUnavailable as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_auto_on_several_hosts_is_unavailable_everywhere():
    results = run_ranks(_two_hosts, 3, timeout=TIMEOUT)
    assert len(set(results)) == 1
    assert "2 hosts" in results[0] and "a2a" in results[0]


def _hold_heap(rank: int, world: int, store: str, queue) -> None:
    join_group(rank, world, store)
    heap = create_heap(EPGroup(), 1 << 20, backend="shm")
    sym = heap.alloc(1024, torch.float32)
    sym.peer((rank + 1) % world).fill_(rank)
    heap.barrier()
    queue.put((rank, heap.token))
    time.sleep(120)


@pytest.mark.distributed
def test_nothing_left_in_dev_shm_after_sigkill():
    with killable_ranks(_hold_heap, 2, TIMEOUT) as (procs, got):
        tokens = {token for _, token in got}
        assert len(tokens) == 1
        token = tokens.pop()
        os.kill(procs[1].pid, signal.SIGKILL)  # type: ignore[arg-type]  # mid-run, heap mapped
        procs[1].join(TIMEOUT)
        assert procs[1].exitcode == -signal.SIGKILL
        assert _job_files(token) == []
    assert _job_files(token) == []


def test_close_in_a_forked_child_leaves_the_parent_heap_intact():
    heap = create_heap(EPGroup(), 4096, backend="shm")
    sym = heap.alloc(8, torch.int64)
    ctx = mp.get_context("fork")
    child = ctx.Process(target=lambda: (heap.close(), sym.local.fill_(5)))
    child.start()
    child.join(TIMEOUT)
    assert child.exitcode == 0
    assert sym.local.tolist() == [5] * 8  # shared mapping, still open in the parent
    assert not heap.closed and heap.alloc(4, torch.float32).offset == ALIGN
    heap.close()


def _fail_one_step(rank: int, world: int, step: str) -> dict:
    """Rank 1 fails at ``step`` of the creation; every rank reports its error and files."""
    import errno

    import moonplan.comm.shm_heap as shm_heap
    from moonplan.comm.shm_files import parse_name

    def broken(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if rank == 1:
        if step == "create":
            shm_heap.os.fchmod = broken  # after the O_EXCL open: the empty file must go
        elif step == "open":
            shm_heap._open_peers = lambda paths, r, fd: [fd] if r == 0 else []
        elif step == "reserve":
            shm_heap.os.posix_fallocate = broken
        else:
            shm_heap._map_fds = lambda fds, n: ([], "cannot map rank 0's file: injected")
    try:
        create_heap(EPGroup(), 1 << 16, backend="shm")
        message = ""
    except ContractError as exc:
        message = str(exc)
    mine = [n for n in os.listdir(SHM_DIR) if (p := parse_name(n)) and p[2].pid == os.getpid()]
    return {"message": message, "files": mine, "pid": os.getpid()}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("step", "what"),
    [
        ("create", "shm heap: create"),
        ("open", "shm heap: open peers"),
        ("reserve", "shm heap: reserve memory"),
        ("map", "shm heap: map peers"),
    ],
)
def test_a_failed_creation_raises_everywhere_and_removes_its_files(step, what):
    from moonplan.comm.shm_files import parse_name

    got = run_ranks(_fail_one_step, 3, step, timeout=TIMEOUT)
    assert len({g["message"] for g in got}) == 1 and what in got[0]["message"], got
    assert "rank 1" in got[0]["message"]
    assert all(g["files"] == [] for g in got)
    pids = {g["pid"] for g in got}
    left = [n for n in os.listdir(SHM_DIR) if (p := parse_name(n)) and p[2].pid in pids]
    assert left == []
