"""The ``ipc`` symmetric heap: its collective logic on CPU ranks through a fake mapper
(exchange, agreements, every error path, close order), the backend choice, and on a GPU
the real CUDA IPC mapper (several ranks on one device; a killed rank frees its memory)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

from moonplan.comm import (
    ContractError,
    EPGroup,
    HeapUnavailable,
    create_heap,
    heap_factory,
    ipc_heap,
)
from moonplan.comm.heap import ALIGN
from moonplan.testing.dist import run_ranks
from tests.comm.fake_ipc import FileMapper
from tests.comm.heap_writes import expected_rows, write_to_peers

TIMEOUT = 30.0


@pytest.fixture
def fake(tmp_path):
    mapper = FileMapper(str(tmp_path))
    ipc_heap.set_mapper(mapper)
    yield mapper
    ipc_heap.set_mapper(None)


def _use(directory: str, **kw) -> FileMapper:
    mapper = FileMapper(directory, **kw)
    ipc_heap.set_mapper(mapper)
    return mapper


def test_single_rank_alloc_and_close_frees(fake):
    heap = create_heap(EPGroup(), 2048, backend="ipc")
    assert heap.backend == "ipc" and heap.device_ids == ["dev0"]
    a = heap.alloc((3, 5), torch.bfloat16)
    b = heap.alloc(7, torch.int64)
    assert [a.offset, b.offset] == [0, ALIGN] and a.peer(0).data_ptr() == a.local.data_ptr()
    assert torch.count_nonzero(b.local) == 0
    with pytest.raises(MemoryError, match="ipc heap full"):
        heap.alloc(1024, torch.float32)
    heap.close()
    heap.close()  # idempotent
    assert [op for op, _, _ in fake.log] == ["allocate", "free"] and fake.files() == []


def test_exit_hook_closes_mappings_and_leaves_the_buffer(fake):
    heap = create_heap(EPGroup(), 256, backend="ipc")
    heap._close_at_exit()  # what atexit runs: no collective, no free (a peer may map it)
    assert heap.closed and [op for op, _, _ in fake.log] == ["allocate"]


def test_env_picks_the_layer_heap(fake, monkeypatch):
    monkeypatch.setenv(heap_factory.ENV, "ipc")
    heap = create_heap(EPGroup(), 64)  # backend=None: what a layer passes
    assert heap.backend == "ipc"
    heap.close()
    monkeypatch.setenv(heap_factory.ENV, "cuda")
    with pytest.raises(ValueError, match="MOONPLAN_HEAP"):
        create_heap(EPGroup(), 64)


def _row(cuda=True, nvshmem=False, device_id="a") -> dict:
    return {"cuda": cuda, "nvshmem": nvshmem, "device_id": device_id}


def test_auto_backend_rule():
    pick = heap_factory._auto_backend
    assert pick([_row(cuda=False, device_id="")] * 2) == "shm"
    assert pick([_row(nvshmem=True, device_id=d) for d in "ab"]) == "nvshmem"
    assert pick([_row(nvshmem=True, device_id="a")] * 2) == "ipc"  # ranks share a GPU
    assert pick([_row(nvshmem=True, device_id="a"), _row(device_id="b")]) == "ipc"
    assert pick([_row(nvshmem=True, device_id="")] * 2) == "ipc"  # devices unknown


def test_cuda_mapper_explains_itself_without_a_gpu():
    from moonplan.comm.ipc_mapper import CudaIpcMapper

    device_id, why = CudaIpcMapper().identity(torch.device("cpu"))
    assert device_id == "" and "CUDA memory" in why
    if not torch.cuda.is_available():
        assert CudaIpcMapper().identity(torch.device("cuda", 0)) == ("", "CUDA is not available")


# ---- several CPU ranks through the fake mapper ------------------------------------------------
def _peer_writes(rank: int, world: int, directory: str) -> dict:
    mapper = _use(directory)
    heap = create_heap(EPGroup(), 1 << 14, backend="ipc")
    out = write_to_peers(heap, rank, world)
    heap.close()
    return {**out, "log": mapper.log}


def _check_close_order(logs: list[list[tuple[str, str, float]]]) -> None:
    """No buffer is freed before every mapping of it is closed (one host clock)."""
    events = [e for log in logs for e in log]
    for op, name, t in events:
        if op == "free":
            closes = [tc for o, n, tc in events if o == "close" and n == name]
            opens = [to for o, n, to in events if o == "open" and n == name]
            assert len(closes) == len(opens) and all(tc < t for tc in closes), (name, events)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_peer_writes_are_seen_after_barrier(world, tmp_path):
    results = run_ranks(_peer_writes, world, str(tmp_path), timeout=TIMEOUT)
    for rank, res in enumerate(results):
        assert res["got"] == expected_rows(rank, world)
        assert len(set(res["ptrs"])) == world
        ops = [op for op, _, _ in res["log"]]
        assert ops == ["allocate"] + ["open"] * (world - 1) + ["close"] * (world - 1) + ["free"]
    _check_close_order([r["log"] for r in results])
    assert FileMapper(str(tmp_path)).files() == []


def _fails(rank: int, world: int, directory: str, where: dict) -> dict:
    kw = where.get(rank, {})
    mapper = _use(directory, **kw)
    try:
        create_heap(EPGroup(), 4096, backend=where.get("backend", "ipc"))
        message, kind = "", ""
    except (HeapUnavailable, ContractError) as exc:
        message, kind = str(exc), type(exc).__name__
    return {"message": message, "kind": kind, "log": mapper.log}


CASES = {
    # rank 2 on another device that ranks 0 and 1 cannot reach (and back)
    "no-p2p": (
        {
            0: {"no_p2p": frozenset({"gpuB"})},
            1: {"no_p2p": frozenset({"gpuB"})},
            2: {"device_id": "gpuB", "no_p2p": frozenset({"dev0"})},
        },
        "HeapUnavailable",
        "ipc heap: peer access",
    ),
    "allocate": ({1: {"fail": frozenset({"allocate"})}}, "ContractError", "ipc heap: allocate"),
    "long-handle": ({0: {"fail": frozenset({"long-handle"})}}, "ContractError", "byte handle"),
    "open": ({2: {"fail": frozenset({"open"})}}, "HeapUnavailable", "ipc heap: map peers"),
    "identity": ({1: {"fail": frozenset({"identity"})}}, "HeapUnavailable", "rank 1: injected"),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_creation_raises_everywhere_and_releases_everything(case, tmp_path):
    where, kind, what = CASES[case]
    got = run_ranks(_fails, 3, str(tmp_path), where, timeout=TIMEOUT)
    assert len({g["message"] for g in got}) == 1, got
    assert {g["kind"] for g in got} == {kind} and what in got[0]["message"], got
    if kind == "HeapUnavailable":
        assert "a2a" in got[0]["message"]
    if case in ("no-p2p", "identity"):  # refused before anything was allocated
        assert all(g["log"] == [] for g in got)
    _check_close_order([g["log"] for g in got])
    freed = sum(op == "free" for g in got for op, _, _ in g["log"])
    assert freed == sum(op == "allocate" for g in got for op, _, _ in g["log"])
    assert FileMapper(str(tmp_path)).files() == []


def test_no_p2p_names_every_pair(tmp_path):
    got = run_ranks(_fails, 3, str(tmp_path), CASES["no-p2p"][0], timeout=TIMEOUT)
    msg = got[0]["message"]
    assert "no P2P from dev0 to gpuB" in msg and "no P2P from gpuB to dev0" in msg
    assert "rank 0" in msg and "rank 1" in msg and "rank 2" in msg


# ---- the real CUDA mapper: several processes on one GPU ----------------------------------------
def _cuda_ranks(rank: int, world: int) -> dict:
    torch.cuda.set_device(0)
    group = EPGroup(device="cuda:0")
    heap = create_heap(group, 1 << 20, backend="ipc")
    sym = heap.alloc((world, 1000), torch.bfloat16)
    for peer in range(world):
        sym.peer(peer)[rank] = torch.full((1000,), rank + 10 * peer, device="cuda").bfloat16()
    heap.barrier()
    got = sym.local.float().cpu()
    auto = create_heap(group, 1 << 10)  # ranks sharing a GPU: auto is ipc
    backends = [heap.backend, auto.backend]
    auto.close()
    heap.close()
    return {"got": got, "backends": backends}


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("world", [2, 4])
def test_cuda_ranks_on_one_gpu_write_each_other(world):
    why = ipc_heap.get_mapper().identity(torch.device("cuda", 0))[1]
    if why:
        pytest.skip(why)
    got = run_ranks(_cuda_ranks, world, timeout=120, start_method="spawn")
    for rank, res in enumerate(got):
        want = torch.tensor([[r + 10.0 * rank] * 1000 for r in range(world)])
        assert torch.equal(res["got"], want) and res["backends"] == ["ipc", "ipc"]


def _hold(rank: int, world: int, store: str, queue) -> None:
    import time

    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    heap = create_heap(EPGroup(device="cuda:0"), 1 << 30, backend="ipc")
    heap.barrier()
    if rank == 1:
        queue.put(("ready", 0))
        time.sleep(300)  # killed here, its heap mapped by rank 0
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    queue.put(("ready", before))
    while not os.path.exists(store + ".killed"):
        time.sleep(0.05)
    heap._close_at_exit()  # rank 0's atexit path: closes its mapping of rank 1's heap
    time.sleep(1.0)
    queue.put(("after", torch.cuda.mem_get_info()[0] - before))


@pytest.mark.gpu
@needs_gpu
def test_a_killed_rank_leaves_its_memory_to_the_driver(tmp_path):
    """Rank 1 is SIGKILLed while rank 0 maps its 1 GiB heap; once rank 0 closed its mapping,
    the device has at least that much more free memory: nothing of rank 1 stays mapped."""
    if ipc_heap.get_mapper().identity(torch.device("cuda", 0))[1]:
        pytest.skip("cuda-python missing")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_hold, args=(r, 2, store, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        [queue.get(timeout=120) for _ in range(2)]
        os.kill(procs[1].pid, signal.SIGKILL)  # type: ignore[arg-type]
        procs[1].join(30)
        open(store + ".killed", "w").close()
        kind, gained = queue.get(timeout=60)
        assert kind == "after" and gained >= 0.9 * (1 << 30), gained
    finally:
        for p in procs:
            p.kill()
            p.join()
