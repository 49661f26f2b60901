"""Backward replays the forward plan; every gradient equals the single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F_

from moonplan.runtime.transports.registry import builtin_name
from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_weights, split, tokens

pytestmark = pytest.mark.distributed


def _dense_layer(x_TH, w: dict, router_w, K: int, ids=None, wk=None):
    """Differentiable dense MoE (fp64): returns y and the route weights used."""
    F = w["down"].shape[2]
    if ids is None:
        prob = torch.softmax(x_TH @ router_w.T, -1)
        wk, ids = torch.topk(prob, K, -1)
        wk = wk / wk.sum(-1, keepdim=True)
    ys = []
    for t in range(x_TH.shape[0]):
        acc = torch.zeros(x_TH.shape[1], dtype=x_TH.dtype)
        for k in range(K):
            e = int(ids[t, k])
            gu = w["gate_up"][e] @ x_TH[t]
            acc = acc + wk[t, k] * (w["down"][e] @ (F_.silu(gu[:F]) * gu[F:]))
        ys.append(acc)
    return torch.stack(ys) if ys else x_TH.new_zeros(0, x_TH.shape[1])


def _cotangent(T: int, H: int, seed: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 2))


def _rank_grads(rank: int, world: int, cfg: dict) -> dict:
    import os

    from moonplan import MoonMoE

    os.environ.update(cfg.get("env", {}))  # this rank process only (forked)
    H, F, E, K, sizes = cfg["H"], cfg["F"], cfg["E"], cfg["K"], cfg["sizes"]
    w = dense_weights(E, H, F, seed=cfg["seed"])
    x_r = split(tokens(sum(sizes), H, cfg["seed"]), sizes)[rank].clone().requires_grad_(True)
    c_r = split(_cotangent(sum(sizes), H, cfg["seed"]), sizes)[rank]
    layer = MoonMoE(
        H,
        F,
        E,
        K,
        slots=cfg.get("slots"),
        align=cfg.get("align", 1),
        transport=cfg.get("transport", "auto"),
    )
    layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
    for _ in range(cfg.get("micro", 1)):
        (layer(x_r) * c_r).sum().backward()
    return {
        "x": x_r.grad,
        "router": layer.router.weight.grad,
        "gate_up": layer.gate_up.grad,
        "down": layer.down.grad,
        "home": layer.home_experts,
        "plans": layer.runtime.plans_made,
    }


def _reference(cfg: dict) -> dict:
    H, F, E, K, sizes, seed = cfg["H"], cfg["F"], cfg["E"], cfg["K"], cfg["sizes"], cfg["seed"]
    w = {k: v.double().requires_grad_(True) for k, v in dense_weights(E, H, F, seed).items()}
    xs = [x.double().requires_grad_(True) for x in split(tokens(sum(sizes), H, seed), sizes)]
    cs = split(_cotangent(sum(sizes), H, seed).double(), sizes)
    routers = []
    total = 0
    for x, c in zip(xs, cs, strict=True):
        rw = w["router_weight"].detach().clone().requires_grad_(True)  # router grads are local
        routers.append(rw)
        total = total + (_dense_layer(x, w, rw, K) * c).sum()
    total.backward()

    def grad(t: torch.Tensor) -> torch.Tensor:  # an empty rank's inputs get no grad here
        return torch.zeros_like(t) if t.grad is None else t.grad

    return {
        "x": [grad(x) for x in xs],
        "router": [grad(r) for r in routers],
        "gate_up": grad(w["gate_up"]),
        "down": grad(w["down"]),
    }


CASES = [
    # (world, E, sizes, slots, align, transport, K); "auto" is the heap here
    (1, 4, [6], None, 1, "auto", 2),
    (2, 4, [7, 5], None, 1, "auto", 2),
    (2, 3, [0, 9], None, 2, "auto", 2),  # a rank with no tokens; E mod R != 0
    (3, 2, [5, 4, 6], None, 1, "auto", 2),  # E < R
    (3, 7, [6, 6, 6], 0, 1, "auto", 2),  # slots = 0: gradients of direct replicas go home too
    (4, 9, [4, 6, 0, 5], 1, 1, "auto", 2),
    (3, 5, [5, 6, 4], None, 1, "a2a", 2),
    # one row per (token, destination rank) on both transports, and per record
    (4, 12, [5, 6, 0, 4], None, 1, builtin_name("heap", "tokens"), 8),  # top-8: rows shared
    (3, 10, [5, 6, 4], 0, 2, builtin_name("a2a", "tokens"), 8),
    (3, 2, [5, 4, 6], None, 1, builtin_name("a2a", "tokens"), 2),
    (3, 2, [0, 4, 6], 0, 2, builtin_name("heap", "tokens"), 2),
    (2, 4, [7, 5], None, 2, builtin_name("heap", "records"), 2),
    (3, 10, [5, 0, 4], 0, 1, builtin_name("a2a", "records"), 8),
]


@pytest.mark.parametrize(("world", "E", "sizes", "slots", "align", "transport", "K"), CASES)
def test_gradients_equal_reference(
    world: int, E: int, sizes: list[int], slots, align: int, transport: str, K: int
) -> None:
    cfg = {
        "H": 8,
        "F": 12,
        "E": E,
        "K": K,
        "seed": 3,
        "sizes": sizes,
        "slots": slots,
        "align": align,
        "transport": transport,
    }
    _assert_reference(run_ranks(_rank_grads, world, cfg, timeout=120), cfg)


def _assert_reference(got: list[dict], cfg: dict) -> None:
    """Every rank's gradients equal the dense fp64 reference's (one plan per step)."""
    want = _reference(cfg)
    for r, g in enumerate(got):
        assert g["plans"] == 1  # backward replays the forward plan
        torch.testing.assert_close(g["x"].double(), want["x"][r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g["router"].double(), want["router"][r], rtol=1e-5, atol=1e-6)
        home = g["home"]
        torch.testing.assert_close(
            g["gate_up"].double(), want["gate_up"][home], rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(g["down"].double(), want["down"][home], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", ["tokens", "records"])
def test_heap_and_all_to_all_gradients_agree_bit_for_bit(rows: str) -> None:
    cfg = {"H": 8, "F": 12, "E": 10, "K": 8, "seed": 4, "sizes": [5, 7, 0], "slots": 1}
    heap, a2a = (
        run_ranks(_rank_grads, 3, {**cfg, "transport": builtin_name(t, rows)}, timeout=120)
        for t in ("heap", "a2a")
    )
    for h, a in zip(heap, a2a, strict=True):
        for key in ("x", "router", "gate_up", "down"):
            assert torch.equal(h[key], a[key]), key


def test_two_stage_on_two_hosts_equals_reference() -> None:
    """Four ranks as two hosts of two: tokens cross hosts once, gradients still exact."""
    cfg = {"H": 8, "F": 12, "E": 10, "K": 8, "seed": 6, "sizes": [5, 0, 6, 4], "slots": 1}
    cfg |= {"transport": "a2a-hosts", "env": {"LOCAL_WORLD_SIZE": "2"}}
    _assert_reference(run_ranks(_rank_grads, 4, cfg, timeout=120), cfg)


def test_micro_batches_accumulate_and_reuse_slots() -> None:
    cfg = {"H": 8, "F": 12, "E": 6, "K": 2, "seed": 5, "sizes": [6, 3, 7], "micro": 3}
    got = run_ranks(_rank_grads, 3, cfg, timeout=120)
    want = _reference(cfg)
    for g in got:
        assert g["plans"] == 3
        home = g["home"]
        torch.testing.assert_close(
            g["gate_up"].double(), 3 * want["gate_up"][home], rtol=1e-5, atol=1e-6
        )


def _phases(rank: int, world: int) -> list[str]:
    from moonplan import MoonMoE

    layer = MoonMoE(8, 12, 4, 2)
    x = torch.randn(5, 8, requires_grad=True)
    layer(x).sum().backward()
    assert layer.last_stats is not None
    return sorted(layer.last_stats.phases)


def test_backward_phases_are_timed() -> None:
    got = run_ranks(_phases, 2, timeout=60)
    want = {"counts", "plan", "prefetch", "prefetch_exposed", "dispatch", "experts", "combine"}
    want |= {"combine_backward", "experts_backward", "dispatch_backward"}
    want |= {"grad_reduce", "grad_reduce_exposed"}
    assert set(got[0]) == set(got[1]) == want
