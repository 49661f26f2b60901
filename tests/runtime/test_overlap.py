"""The overlapped schedule gives bit-identical outputs and gradients to the serial one.

Legend: T tokens (all ranks), H hidden, F ffn, E experts, K top-k.

Two layers with the same weights run in the same processes, one with
``overlap=True`` (prefetch in a worker thread beside dispatch and the home experts,
replica-gradient reads beside the dispatch-backward; on the all-to-all transports the
worker's collectives run on the layer's second process group, more in
``test_overlap_a2a.py``) and one with ``overlap=False``;
every step's output, input gradient and expert gradients must be equal bit for bit.
The steps drift the routing (new slots, residents, direct reads), update the
weights in place between steps (republish, every slot stale) and grow the receive
buffers (heap rebuilt while the worker exists).
"""

from __future__ import annotations

import threading

import pytest
import torch

from moonplan.runtime.transports.registry import builtin_name
from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_weights, tokens

pytestmark = pytest.mark.distributed


def _biased_router(layer, bias_holder: dict, K: int):
    from moonplan.runtime.routers import softmax_topk

    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(layer.router(x) + bias_holder["bias"], K)

    return route


def make_layers(cfg: dict, group=None) -> tuple[dict, dict]:
    """``({overlap: layer}, {overlap: bias holder})``: the same weights and biased
    router, one layer with the overlapped schedule and one serial (collective), on
    ``group`` (an ``EPGroup``; ``None``: the whole world)."""
    from moonplan import MoonMoE

    H, F, E, K = cfg["H"], cfg["F"], cfg["E"], cfg["K"]
    w = dense_weights(E, H, F, seed=3)
    layers, holders = {}, {}
    for overlap in (True, False):
        holder = {"bias": torch.zeros(E)}
        layer = MoonMoE(
            H,
            F,
            E,
            K,
            slots=cfg["slots"],
            max_tokens=cfg["max_tokens"],
            transport=cfg["transport"],
            balance="exact",
            overlap=overlap,
            group=group,
        )
        layer.route_fn = _biased_router(layer, holder, K)
        layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
        layers[overlap], holders[overlap] = layer, holder
    return layers, holders


def run_steps(rank: int, world: int, cfg: dict, layers: dict, holders: dict) -> dict:
    """Forward and backward of every step of ``cfg["tokens"]`` on both layers:
    ``{overlap: [per-step outputs, gradients and figures]}``."""
    H, E = cfg["H"], cfg["E"]
    out: dict = {True: [], False: []}
    g = torch.Generator().manual_seed(11)
    for step, n in enumerate(cfg["tokens"]):
        bias = torch.randn(E, generator=g) * 3.0  # drifting skew: new slots each step
        x = tokens(n * world, H, 20 + step)[rank * n : (rank + 1) * n]
        c = torch.randn(n, H, generator=torch.Generator().manual_seed(40 + step + rank))
        for overlap, layer in layers.items():
            holders[overlap]["bias"] = bias
            xr = x.clone().requires_grad_(True)
            layer.zero_grad()
            y = layer(xr)
            (y * c).sum().backward()
            s = layer.last_stats
            out[overlap].append(
                {
                    "y": y.detach(),
                    "dx": xr.grad,
                    "gate_up": layer.gate_up.grad.clone(),
                    "down": layer.down.grad.clone(),
                    "new_copies": s.new_copies,
                    "direct": s.direct_reads,
                    "phases": dict(s.phases),
                }
            )
            with torch.no_grad():  # an optimizer-like in-place update: republish next step
                layer.gate_up.mul_(0.999)
    return out


def assert_same_steps(got: list[dict]) -> int:
    """Every rank's overlapped steps equal the serial ones bit for bit, with the
    background phases recorded; returns the weight rows fetched (all ranks, steps)."""
    moved = 0
    for r in got:
        for a, b in zip(r[True], r[False], strict=True):
            for key in ("y", "dx", "gate_up", "down"):
                assert torch.equal(a[key], b[key]), key
            moved += a["new_copies"] + a["direct"]
            assert a["phases"]["prefetch"] >= 0 and a["phases"]["prefetch_exposed"] >= 0
            assert "grad_reduce" in a["phases"] and "grad_reduce_exposed" in a["phases"]
    return moved


def _run(rank: int, world: int, cfg: dict) -> dict:
    layers, holders = make_layers(cfg)
    threads: set[str] = set()
    store_cls = type(layers[True].runtime.store)
    original = store_cls.prefetch

    def spy(self, plan):  # records which thread fills the slots
        threads.add(threading.current_thread().name)
        return original(self, plan)

    store_cls.prefetch = spy  # type: ignore[method-assign]
    out = run_steps(rank, world, cfg, layers, holders)
    store_cls.prefetch = original  # type: ignore[method-assign]
    out["threads"] = sorted(threads)
    out["lane"] = layers[True].runtime.lane().kind
    for layer in layers.values():
        layer.runtime.close()
    return out


CASES = [
    # world, E, slots, transport, tokens per rank per step (growth: max_tokens is small)
    (2, 6, None, "auto", [12, 40, 7]),
    (3, 7, 1, "auto", [9, 9, 30]),  # few slots: direct reads too
    (3, 5, 0, "auto", [10, 0, 10]),  # no slots: every replica direct; an empty step
    (2, 4, None, "a2a", [12, 20]),  # all-to-all: the worker on a second process group
    (3, 7, 1, builtin_name("heap", "tokens"), [9, 9, 30]),  # token rows: reduce in the hook
    (2, 4, None, builtin_name("a2a", "records"), [12, 20]),
]


@pytest.mark.parametrize(("world", "E", "slots", "transport", "sizes"), CASES)
def test_overlapped_equals_serial_bit_for_bit(world, E, slots, transport, sizes) -> None:
    cfg = {"H": 8, "F": 12, "E": E, "K": 2, "slots": slots, "transport": transport}
    cfg |= {"tokens": sizes, "max_tokens": 4}
    got = run_ranks(_run, world, cfg, timeout=120)
    assert assert_same_steps(got) > 0  # the case exercises the prefetch at all
    for r in got:  # the overlapped layer's prefetch ran in its worker, the serial one's inline
        assert r["lane"] == "thread"
        assert r["threads"] == ["MainThread", "moonplan-bg_0"]


def _slow_prefetch(rank: int, world: int) -> dict:
    """A prefetch made slow on purpose: the worker's time counts in ``prefetch``, the
    experts' wait (most of it here: dispatch is fast) in ``prefetch_exposed``. Every
    record goes to expert 0 (rank 0's), so rank 1 fills a slot with it; rank 0 fetches
    nothing and starts no job at all."""
    import time

    from moonplan import MoonMoE

    def hot(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(x.shape[0], 1, dtype=torch.int64)
        return ids, torch.ones(x.shape[0], 1) + 0 * x.sum()

    layer = MoonMoE(8, 8, 4, 1, slots=2, balance="exact", router=hot)
    store_cls = type(layer.runtime.store)
    original = store_cls.prefetch

    def slow(self, plan):
        time.sleep(0.2)
        return original(self, plan)

    store_cls.prefetch = slow  # type: ignore[method-assign]
    with torch.no_grad():
        layer(torch.randn(16, 8))
    store_cls.prefetch = original  # type: ignore[method-assign]
    out = dict(layer.last_stats.phases)
    out["new_copies"] = layer.last_stats.prefetched_rows
    layer.runtime.close()
    return out


def test_prefetch_time_is_measured_in_the_worker_and_the_wait_is_exposed() -> None:
    idle, busy = run_ranks(_slow_prefetch, 2, timeout=60)
    assert busy["new_copies"] == 1 and idle["new_copies"] == 0
    assert busy["prefetch"] >= 0.2
    assert 0.1 <= busy["prefetch_exposed"] <= busy["prefetch"] + 0.05
    assert idle["prefetch"] == 0.0  # no job started
