"""Fault injection: every rank ends a bad step with the same error, within seconds, the
layer works afterwards, and nothing of the job stays in /dev/shm (docs/reliability.md)."""

from __future__ import annotations

import errno
import os
import resource
import time

import numpy as np
import pytest
import torch

from moonplan.comm.shm_files import SHM_DIR, parse_name
from moonplan.testing.dist import run_ranks

pytestmark = pytest.mark.distributed

H, F, E, K = 8, 12, 5, 2
TIMEOUT = 60.0
FAST_S = 10.0  # an error must reach every rank well within this


def _router(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(x.shape[0])
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(x.shape[0])])
    return ids.view(-1, K), torch.full((x.shape[0], K), 0.5)


def _files_of(pids: set[int]) -> list[str]:
    """moonplan files in /dev/shm created by one of ``pids`` (the test's ranks)."""
    out = []
    for name in os.listdir(SHM_DIR):
        parsed = parse_name(name)
        if parsed is not None and parsed[2].pid in pids:
            out.append(name)
    return out


def _step_error(layer, x) -> tuple[str, float]:
    from moonplan.comm.errors import ContractError

    t0 = time.perf_counter()
    try:
        layer(x)
    except ContractError as exc:
        return str(exc), time.perf_counter() - t0
    return "", time.perf_counter() - t0


def _bad_contribution(rank: int, world: int, kind: str, transport: str) -> dict:
    from moonplan import MoonMoE

    state = {"bad": rank == 1}

    def router(x: torch.Tensor):
        ids, w = _router(x)
        if state["bad"] and kind == "lists":
            return ids.tolist(), w.tolist()
        if state["bad"] and kind == "numpy":
            return ids.numpy(), w.numpy()
        if state["bad"] and kind == "not-a-pair":
            return ids
        return ids, w

    torch.manual_seed(0)
    layer = MoonMoE(H, F, E, K, router=router, transport=transport)
    x = torch.randn(4, H)
    if state["bad"] and kind in ("float16", "bfloat16", "float64", "int64"):
        x = x.to(getattr(torch, kind))
    message, seconds = _step_error(layer, x)
    state["bad"] = False
    y = layer(torch.randn(3, H))
    return {"message": message, "seconds": seconds, "ok": bool(torch.isfinite(y).all())}


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("float16", "x is torch.float16 but the layer runs in torch.float32"),
        ("bfloat16", "x is torch.bfloat16"),
        ("float64", "x is torch.float64"),
        ("int64", "x is torch.int64"),
        ("lists", "router must return torch tensors (topk_ids, topk_weight), got (list, list)"),
        ("numpy", "got (numpy.ndarray, numpy.ndarray)"),
        ("not-a-pair", "router must return (topk_ids, topk_weight)"),
    ],
)
@pytest.mark.parametrize("transport", ["heap", "a2a"])
def test_bad_contribution_of_one_rank_raises_the_same_error_everywhere(kind, words, transport):
    got = run_ranks(_bad_contribution, 3, kind, transport, timeout=TIMEOUT)
    messages = {g["message"] for g in got}
    assert len(messages) == 1, messages
    (message,) = messages
    assert words in message and "rank 1" in message, message
    assert all(g["seconds"] < FAST_S and g["ok"] for g in got), got


def _grow_fails(rank: int, world: int, fault: str) -> dict:
    """Rank 1 cannot reserve a bigger heap; the step that needs it fails everywhere."""
    from moonplan import MoonMoE

    layer = MoonMoE(H, F, E, K, router=_router, transport="heap", max_tokens=4)
    rt = layer.runtime
    layer(torch.randn(4, H))  # fits: no growth
    heap, capacity = rt.heap, rt.capacity
    restore = None
    if rank == 1 and fault == "enospc":
        real = os.posix_fallocate

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        os.posix_fallocate = full  # type: ignore[assignment]
        restore = real
    elif rank == 1 and fault == "fsize":
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (heap.nbytes + 4096, limit[1]))
        restore = limit
    message, seconds = _step_error(layer, torch.randn(400, H))  # needs 800 rows
    same_heap = rt.heap is heap and rt.capacity == capacity and not heap.closed
    files = _files_of({os.getpid()})
    y_small = layer(torch.randn(4, H))  # the old heap still serves
    if restore is not None and fault == "enospc":
        os.posix_fallocate = restore  # type: ignore[assignment]
    elif restore is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, restore)
    y_big = layer(torch.randn(400, H))  # now the growth succeeds
    return {
        "message": message,
        "seconds": seconds,
        "same_heap": same_heap,
        "files": files,
        "ok": bool(torch.isfinite(y_small).all() and torch.isfinite(y_big).all()),
        "grown": rt.capacity > capacity,
        "pid": os.getpid(),
    }


@pytest.mark.parametrize(("fault", "words"), [("enospc", "No space left"), ("fsize", "too large")])
def test_failed_heap_growth_keeps_the_old_heap_everywhere(fault, words):
    got = run_ranks(_grow_fails, 3, fault, timeout=TIMEOUT)
    messages = {g["message"] for g in got}
    assert len(messages) == 1, messages
    (message,) = messages
    assert "shm heap: reserve memory" in message and "rank 1" in message, message
    assert words in message, message
    for g in got:
        assert g["same_heap"] and g["files"] == [] and g["ok"] and g["grown"], g
        assert g["seconds"] < FAST_S
    assert _files_of({g["pid"] for g in got}) == []


def _moved(rank: int, world: int, how: str) -> str:
    from moonplan import MoonMoE

    layer = MoonMoE(H, F, E, K, router=_router)
    layer.to(torch.float32).float()  # no change: allowed
    try:
        if how == "dtype":
            layer.to(torch.bfloat16)
        else:
            layer.half()
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = ""
    y = layer(torch.randn(3, H))  # untouched by the refused move
    assert y.dtype == torch.float32 and layer.gate_up.dtype == torch.float32
    return message


@pytest.mark.parametrize("how", ["dtype", "half"])
def test_moving_a_layer_after_construction_is_refused_with_what_to_do(how):
    got = run_ranks(_moved, 2, how, timeout=TIMEOUT)
    assert got[0] == got[1] != ""
    assert "cannot move from torch.float32" in got[0] and "before wrapping" in got[0]


def _param_swapped(rank: int, world: int) -> str:
    from moonplan import MoonMoE

    layer = MoonMoE(H, F, E, K, router=_router)
    if rank == 0:  # a change .to() does not see: the Parameter's data replaced
        layer.down.data = layer.down.data.double()
    message, _ = _step_error(layer, torch.randn(3, H))
    return message


def test_parameters_replaced_behind_the_layers_back_raise_everywhere():
    got = run_ranks(_param_swapped, 2, timeout=TIMEOUT)
    assert got[0] == got[1] and "parameter down is torch.float64" in got[0]


def test_router_outputs_of_the_wrong_kind_on_one_process():
    from moonplan import MoonMoE
    from moonplan.comm.errors import ContractError

    for out, words in [
        ((np.zeros((3, K), dtype=np.int64), np.ones((3, K))), "numpy.ndarray"),
        ((torch.zeros(3, K), torch.ones(3, K)), "expert ids of dtype torch.float32"),
        ((torch.zeros(3, K, dtype=torch.long), torch.ones(3, K, dtype=torch.long)), "weights"),
        (None, "got NoneType"),
    ]:
        layer = MoonMoE(H, F, E, K, router=lambda x, out=out: out)
        with pytest.raises(ContractError, match="rank 0") as info:
            layer(torch.randn(3, H))
        assert words in str(info.value)


def test_wrapped_model_refuses_a_later_cast_and_says_to_cast_first():
    pytest.importorskip("transformers")
    from moonplan import adapters
    from moonplan.comm.errors import ContractError
    from tests.adapters.tiny import batch, make_model

    model = adapters.wrap_model(make_model("Mixtral"))
    model.to(torch.float32)  # no change: allowed
    with pytest.raises(RuntimeError, match="cast or move the model before wrapping it"):
        model.to(torch.bfloat16)
    _, experts = next(adapters.moon_experts(model))
    assert experts.gate_up_proj.dtype == torch.float32
    with pytest.raises(ContractError, match=r"x is torch\.bfloat16 but the layer runs in"):
        experts(torch.zeros(3, experts.hidden_dim, dtype=torch.bfloat16), *_route(3))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing converted
    ids = batch(0, [5], seed=1)
    assert torch.isfinite(model(input_ids=ids).logits).all()
    with pytest.raises(RuntimeError, match="before wrapping"):
        model.half()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    cast_first = adapters.wrap_model(make_model("Mixtral").to(torch.bfloat16))
    assert cast_first(input_ids=ids).logits.dtype == torch.bfloat16


def _route(S: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(S, 2, dtype=torch.long), torch.full((S, 2), 0.5)


def test_contract_checks_name_what_is_wrong():
    from moonplan.runtime import contract as c

    cpu, meta = torch.device("cpu"), torch.device("meta")
    f32 = torch.float32
    assert c.check_tokens(torch.zeros(2, H), H, f32, cpu) == ""
    assert c.check_tokens(torch.zeros(1, 2, H), H, f32, cpu) == ""
    assert "got list" in c.check_tokens([[0.0] * H], H, f32, cpu)
    assert "expected x of shape" in c.check_tokens(torch.zeros(2, 2, 2, H), H, f32, cpu)
    assert c.check_tokens(torch.zeros(2, 2, 2, H), H, f32, cpu, dims=None) == ""
    assert "on meta but the layer runs on cpu" in c.check_tokens(
        torch.zeros(2, H, device=meta), H, f32, cpu
    )
    assert c.same_device(cpu, torch.device("cpu")) and not c.same_device(cpu, meta)
    ids, w = _router(torch.zeros(3, H))
    assert c.check_routing(ids, w, 3, E, K, cpu) == ""
    assert "ids on meta" in c.check_routing(ids.to(meta), w, 3, E, K, cpu)
    assert "expected (3, 2) each" in c.check_routing(ids[:2], w[:2], 3, E, K, cpu)
    assert "floating point" in c.check_routing(ids, ids, 3, E, K, cpu)
    assert "router raised ZeroDivisionError" in c.call_router(lambda x: 1 / 0, ids)[2]
    assert "parameter w is torch.float64" in c.check_params({"w": w.double()}, f32, cpu)


def _a2a_grow_fails(rank: int, world: int) -> dict:
    """Rank 1 cannot allocate the bigger all-to-all buffers (a local, one-rank failure)."""
    import moonplan.runtime.buffers as buffers
    from moonplan import MoonMoE

    layer = MoonMoE(H, F, E, K, router=_router, transport="a2a", max_tokens=4)
    rt = layer.runtime
    layer(torch.randn(4, H))
    old = (rt.transport, rt.store, rt.capacity)
    real = buffers.registry.create
    if rank == 1:

        def no_memory(*args, **kwargs):
            raise MemoryError("injected: cannot allocate the receive rows")

        buffers.registry.create = no_memory  # type: ignore[assignment]
    message, seconds = _step_error(layer, torch.randn(400, H))
    kept = (rt.transport, rt.store, rt.capacity) == old
    y_small = layer(torch.randn(4, H))
    buffers.registry.create = real
    y_big = layer(torch.randn(400, H))
    ok = bool(torch.isfinite(y_small).all() and torch.isfinite(y_big).all())
    return {"message": message, "seconds": seconds, "kept": kept, "ok": ok}


def test_failed_local_allocation_during_growth_raises_everywhere_and_keeps_buffers():
    got = run_ranks(_a2a_grow_fails, 3, timeout=TIMEOUT)
    assert len({g["message"] for g in got}) == 1
    message = got[0]["message"]
    assert "layer buffers for" in message and "rank 1: MemoryError: injected" in message
    assert all(g["kept"] and g["ok"] and g["seconds"] < FAST_S for g in got), got
