"""Steps under ``torch.inference_mode()``, ``torch.no_grad()`` and autograd mix on a layer.

Legend: R ranks, E experts, B slots, T tokens (all ranks), H hidden, F ffn, K top-k.

:func:`~moonplan.runtime.outside_inference.outside_inference` itself: the caller's grad
mode kept, inference mode left, tensors made inside normal. Then layers on 1 and 2 gloo
ranks under every ``balance`` (``"auto"`` with a given cost, so its plans are the same
in every run), with and without slots, with buffers that grow inside an inference step
(``max_tokens`` smaller than a step): an inference step, then ``no_grad``, then autograd
with a backward, and the reverse order. Before the fix the step after an inference step
raised ("Inplace update to inference tensor outside InferenceMode", "Inference tensors
cannot be saved for backward"): plans, load windows, the placer's decisions and grown
buffers were inference tensors. Every step's output (and the autograd step's gradients)
must equal, bit for bit, those of a fresh layer that ran the same steps without
inference mode.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moonplan.runtime.outside_inference import outside_inference
from moonplan.stepcost import StepCost
from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_weights, split, tokens

H, F, E, K, SEED, TIMEOUT = 8, 12, 6, 2, 5, 120.0
# Rows cost 1 us each, an expert copy 10 us: auto buys replicas, deterministically.
CHEAP_COPIES = StepCost(1e-6, 0.0, 0.0, 1e-5, 1e-5, 0.0, 0.0, 0.0, 0.0)
FORWARD = ("inference", "no_grad", "grad", "inference", "grad")
REVERSE = ("grad", "no_grad", "inference", "inference", "no_grad", "grad")


# ---- the context ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("caller", "grad"),
    [(torch.inference_mode, False), (torch.no_grad, False), (torch.enable_grad, True)],
)
def test_the_callers_grad_mode_stays_and_inference_mode_goes(caller: Any, grad: bool) -> None:
    with caller():
        made_outside = torch.ones(3)
        with outside_inference():
            assert torch.is_grad_enabled() is grad
            assert not torch.is_inference_mode_enabled()
            made = made_outside * 2  # the caller's inference tensors can be read
        assert torch.is_grad_enabled() is grad  # restored
    assert not made.is_inference()
    made.add_(1)  # a normal tensor: writable outside inference mode


def test_it_decorates_a_function() -> None:
    @outside_inference()
    def make() -> torch.Tensor:
        return torch.zeros(2)

    with torch.inference_mode():
        kept = make()
    assert not kept.is_inference()


# ---- layers -----------------------------------------------------------------------------
def _hot_router(offset: int):
    """Expert 0 takes half the first records (a replica pays), the same on every run."""

    def route(x_SH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(SEED + int(x_SH.shape[0]))
        T = offset + x_SH.shape[0]
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])[offset:]
        ids[: ids.shape[0] // 2, 0] = 0
        w = torch.softmax(torch.randn(T, K, generator=g), -1)[offset:]
        return ids, w * (1 + 0 * x_SH.sum())

    return route


def _step(layer: Any, x_SH: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
    """One step in ``mode``: the output; with autograd, also ``dx`` and ``dgate_up``."""
    if mode == "inference":
        with torch.inference_mode():
            y = layer(x_SH)
        return {"y": y.clone()}
    if mode == "no_grad":
        with torch.no_grad():
            return {"y": layer(x_SH)}
    x_SH = x_SH.clone().requires_grad_(True)
    layer.zero_grad()
    y = layer(x_SH)
    y.square().sum().backward()
    return {"y": y.detach(), "dx": x_SH.grad, "dgate_up": layer.gate_up.grad.clone()}


def _run(rank: int, cfg: dict, modes: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
    """A fresh layer's steps in ``modes``, then the layer closed."""
    from moonplan import MoonMoE

    sizes = cfg["sizes"]
    w = dense_weights(E, H, F, seed=SEED)
    layer = MoonMoE(
        H, F, E, K, balance=cfg["balance"], slots=cfg["slots"], max_tokens=cfg["max_tokens"],
        cost=CHEAP_COPIES if cfg["balance"] == "auto" else None,
        router=_hot_router(sum(sizes[:rank])),
    )  # fmt: skip
    layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
    xs = [split(tokens(sum(sizes), H, 30 + t), sizes)[rank] for t in range(len(modes))]
    out = [_step(layer, x, mode) for x, mode in zip(xs, modes, strict=True)]
    layer.runtime.close()
    return out


def _mixed_and_fresh(rank: int, world: int, cfg: dict, modes: tuple[str, ...]) -> tuple:
    """The steps in ``modes``, and a fresh layer's with no_grad for inference mode."""
    plain = tuple("no_grad" if m == "inference" else m for m in modes)
    return _run(rank, cfg, modes), _run(rank, cfg, plain)


CASES = [
    # (world, sizes, balance, slots, max_tokens); max_tokens=2: the buffers grow in step 1
    (1, [13], "exact", None, 1024),
    (1, [13], "auto", 3, 2),
    (2, [9, 7], "auto", 2, 1024),
    (2, [9, 7], "auto", 2, 2),
    (2, [9, 7], "exact", None, 2),
    (2, [9, 7], "off", 0, 2),
]


@pytest.mark.distributed
@pytest.mark.parametrize("modes", [FORWARD, REVERSE], ids=["inference-first", "grad-first"])
@pytest.mark.parametrize(("world", "sizes", "balance", "slots", "max_tokens"), CASES)
def test_steps_in_any_mode_equal_a_fresh_layers(
    world: int, sizes: list[int], balance: str, slots: int | None, max_tokens: int, modes
) -> None:
    cfg = {"sizes": sizes, "balance": balance, "slots": slots, "max_tokens": max_tokens}
    got = run_ranks(_mixed_and_fresh, world, cfg, modes, timeout=TIMEOUT)
    for mixed, fresh in got:
        for t, (a, b) in enumerate(zip(mixed, fresh, strict=True)):
            assert a.keys() == b.keys()
            for name in a:
                assert not a[name].is_inference()
                assert torch.equal(a[name], b[name]), f"step {t} ({modes[t]}): {name} differs"


# ---- torchtitan's front end: its step makes the cast copies it hands the runtime ----------
def _grouped_steps(rank: int, world: int, modes: tuple[str, ...]) -> list[torch.Tensor]:
    """``MoonGroupedExperts`` (no torchtitan needed) in ``modes``: each step's output."""
    from moonplan.adapters.torchtitan import MoonGroupedExperts

    g = torch.Generator().manual_seed(SEED)
    w1, w3 = (torch.randn(E, F, H, generator=g) for _ in range(2))
    w2 = torch.randn(E, H, F, generator=g)
    experts = MoonGroupedExperts(w1, w2, w3, K, compute_dtype=torch.float32, slots=2)
    out = []
    for t, mode in enumerate(modes):
        x_TD = tokens(8 + rank, H, 40 + t)
        ids_TK, w_TK = _hot_router(0)(x_TD)
        if mode == "grad":
            y = experts.run(x_TD, ids_TK, w_TK)
            y.square().sum().backward()
        else:
            with torch.inference_mode() if mode == "inference" else torch.no_grad():
                y = experts.run(x_TD, ids_TK, w_TK)
        out.append(y.detach().clone())
    experts.runtime.close()
    return out


@pytest.mark.distributed
def test_torchtitans_experts_mix_the_modes_too() -> None:
    """Before the fix its step under inference mode raised at once: the runtime reads
    the version counters of the parameters it is given, and cast copies made in
    inference mode have none."""
    got = run_ranks(_grouped_steps, 2, FORWARD, timeout=TIMEOUT)
    plain = tuple(m.replace("inference", "no_grad") for m in FORWARD)
    want = run_ranks(_grouped_steps, 2, plain, timeout=TIMEOUT)
    for mixed, fresh in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mixed, fresh, strict=True))
