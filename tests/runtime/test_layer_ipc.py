"""MoonMoE over the ``ipc`` heap equals a dense fp64 oracle, forward and backward, in every
balance mode, with token rows and record rows.

Legend: R ranks, E experts, H hidden, F ffn, K top-k, T tokens (all ranks).

The same rank function runs twice: on CPU ranks through the fake mapper
(``tests/comm/fake_ipc.py``: the ipc heap's collective code, fp32, tight tolerance), and
marked ``gpu`` on 2 and 4 processes sharing one CUDA device (the CUDA IPC mapper, the
Triton kernels on mapped peer memory, bf16, bf16 tolerance). Each rank builds one layer
per (transport, balance) in turn with the same weights and runs a few steps of skewed
routing (expert 0 hot, so exact and auto place replicas).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F_

from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_weights, split, tokens

H, F, E, K, STEPS = 64, 32, 8, 2, 3
TRANSPORTS = ("heap", "heap-tokens")  # record rows (the heap's default), token rows
BALANCES = ("off", "exact", "auto")


def _routing(T: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [T, K]`` (expert 0 takes half the tokens' first choice), ``w [T, K]``."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[: T // 2, 0] = 0
    ids[: T // 2, 1] = torch.where(ids[: T // 2, 1] == 0, 1, ids[: T // 2, 1])
    return ids, torch.softmax(torch.randn(T, K, generator=g), -1)


def _upstream(T: int, step: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(200 + step))


def _router(ids_TK: torch.Tensor, w_TK: torch.Tensor, offset: int):
    def route(x_SH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        S, dev = x_SH.shape[0], x_SH.device
        w = w_TK[offset : offset + S].to(dev, x_SH.dtype)
        return ids_TK[offset : offset + S].to(dev), w * (1 + 0 * x_SH.sum())

    return route


def _group_and_dtype(cfg: dict):
    from moonplan.comm import EPGroup
    from moonplan.comm.ipc_heap import set_mapper

    os.environ["MOONPLAN_HEAP"] = "ipc"
    if cfg["device"] == "cuda":
        torch.cuda.set_device(0)
        return EPGroup(device="cuda:0"), torch.bfloat16
    from tests.comm.fake_ipc import FileMapper

    set_mapper(FileMapper(cfg["dir"]))
    return EPGroup(), torch.float32


def _layer_steps(rank: int, world: int, cfg: dict) -> dict:
    """Per (transport, balance): every step's ``y``, ``dx``, home ``gate_up``/``down``
    gradients (CPU fp32), and the heap and policies the steps reported."""
    from moonplan import MoonMoE

    group, dtype = _group_and_dtype(cfg)
    sizes, w = cfg["sizes"], dense_weights(E, H, F, seed=3)
    offset, T = sum(sizes[:rank]), sum(sizes)
    out = {}
    for transport in TRANSPORTS:
        for balance in BALANCES:
            layer = MoonMoE(H, F, E, K, group=group, dtype=dtype, transport=transport,
                            balance=balance, router=lambda x: x, max_tokens=16)  # fmt: skip
            layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
            steps = []
            for step in range(STEPS):
                layer.route_fn = _router(*_routing(T, step), offset)
                x = split(tokens(T, H, step), sizes)[rank].to(group.device, dtype)
                x.requires_grad_(True)
                layer.zero_grad()
                y = layer(x)
                g = split(_upstream(T, step), sizes)[rank].to(group.device)
                (y.float() * g).sum().backward()
                grads = [t.grad.float().cpu() for t in (x, layer.gate_up, layer.down)]
                s = layer.last_stats
                steps.append([y.detach().float().cpu(), *grads, s.heap, s.policy])
            layer.runtime.close()
            out[f"{transport}/{balance}"] = steps
    return out


def _dense(sizes: list[int], step: int) -> dict[str, torch.Tensor]:
    """The fp64 layer on every token of the step: ``y``, ``dx``, ``gate_up``, ``down``."""
    T = sum(sizes)
    w = {k: v.double().requires_grad_(True) for k, v in dense_weights(E, H, F, seed=3).items()}
    x = tokens(T, H, step).double().requires_grad_(True)
    ids, wk = _routing(T, step)
    gate_up, down = w["gate_up"][ids], w["down"][ids]  # [T, K, 2F, H], [T, K, H, F]
    gu = torch.einsum("tkfh,th->tkf", gate_up, x)
    h = F_.silu(gu[..., :F]) * gu[..., F:]
    y = torch.einsum("tk,tkhf,tkf->th", wk.double(), down, h)
    (y * _upstream(T, step).double()).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "gate_up": w["gate_up"].grad, "down": w["down"].grad}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp(min=1e-30))


def _check(got: list[dict], sizes: list[int], tol: float) -> None:
    for key in got[0]:
        for step in range(STEPS):
            want = _dense(sizes, step)
            ranks = [g[key][step] for g in got]
            assert {r[4] for r in ranks} == {"ipc"}, key
            errs = {
                "y": _rel(torch.cat([r[0] for r in ranks]), want["y"]),
                "dx": _rel(torch.cat([r[1] for r in ranks]), want["dx"]),
                "gate_up": _rel(torch.cat([r[2] for r in ranks]), want["gate_up"]),
                "down": _rel(torch.cat([r[3] for r in ranks]), want["down"]),
            }
            assert max(errs.values()) < tol, (key, step, errs)
    policies = {r[5] for g in got for r in g["heap/exact"]}
    assert policies == {"exact"}


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "sizes"), [(2, [24, 16]), (3, [12, 0, 20])])
def test_cpu_ranks_over_the_fake_ipc_heap(world, sizes, tmp_path):
    cfg = {"device": "cpu", "dir": str(tmp_path), "sizes": sizes}
    got = run_ranks(_layer_steps, world, cfg, timeout=240)
    _check(got, sizes, tol=1e-5)
    assert not any(n.startswith("buf-") for n in os.listdir(tmp_path))  # every heap freed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("world", "sizes"), [(2, [24, 16]), (4, [12, 0, 20, 9])])
def test_gpu_ranks_sharing_one_device(world, sizes):
    from moonplan.comm.ipc_heap import get_mapper

    why = get_mapper().identity(torch.device("cuda", 0))[1]
    if why:
        pytest.skip(why)
    got = run_ranks(_layer_steps, world, {"device": "cuda", "sizes": sizes}, timeout=300,
                    start_method="spawn")  # fmt: skip
    _check(got, sizes, tol=2e-2)  # bf16 parameters and activations
