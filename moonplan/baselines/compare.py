"""Baselines side by side on the same multi-layer counts and the same metrics.

Legend: L MoE layers, T steps, R ranks, E experts;
``counts_LTRE`` int64 ``[L, T, R, E]`` (each layer has its own router counts).

Every policy gets a fresh instance per layer (EPLB's history and moonplan's resident
slots are per layer, as in a real model) and runs the layer's ``T`` steps. Reported
per policy, measured over steps ``warmup:``:

* ``balancedness_layer_min`` / ``_mean``: mean/max records per rank of one layer
  in one step, worst and average over (layer, step);
* ``balancedness_summed``: vLLM's form, ``sum_l mean_l / sum_l max_l`` over the
  layers of one step, averaged over steps;
* ``max_over_mean``: max/mean records per rank, averaged over (layer, step);
* ``copies``, ``new_copies``, ``moved_bytes`` per step, summed over layers;
* ``dropped_fraction``: dropped / offered records.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from moonplan.baselines.metrics import balancedness_per_layer, balancedness_summed, imbalance
from moonplan.baselines.policy_base import PolicyStep
from moonplan.baselines.prehistory import Prehistory, UsesPrehistory, step_ranges
from moonplan.baselines.registry import make_policy, names

Before = Callable[[int, torch.Tensor], Prehistory]
"""``before(layer, steps_N)``: the per-expert totals of the steps ``steps_N`` before layer
``layer``'s trace (for the policies that read them, ``moonplan.baselines.prehistory``)."""


def run_layers(
    counts_LTRE: torch.Tensor, name: str, before: Before | None = None, **options: Any
) -> list[list[PolicyStep]]:
    """``steps[l][t]``: policy ``name`` (fresh per layer, primed from ``before`` if it reads
    the steps before the trace) over every layer's steps."""
    L, _, R, E = counts_LTRE.shape
    out = []
    for layer in range(L):
        policy = make_policy(name, R, E, **options)
        if before is not None and isinstance(policy, UsesPrehistory):
            policy.prime(before(layer, step_ranges(policy.steps_before())))
        out.append([policy.step(c) for c in counts_LTRE[layer]])
    return out


def compare_policies(
    counts_LTRE: torch.Tensor,
    policies: Sequence[str] | None = None,
    *,
    expert_bytes: float = 0.0,
    warmup: int = 0,
    before: Before | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """One dict of metrics per policy (default: every registered one, ``names()``; see the
    module docstring); ``options`` go to :func:`make_policy` (e.g. EPLB's ``eplb_period``),
    ``before`` primes the policies that read the steps before each layer's trace."""
    if counts_LTRE.dim() != 4:
        raise ValueError(f"counts must be [L, T, R, E], got shape {tuple(counts_LTRE.shape)}")
    if not 0 <= warmup < counts_LTRE.shape[1]:
        raise ValueError(f"warmup = {warmup} leaves no measured step")
    return [
        _metrics(name, run_layers(counts_LTRE, name, before, **options), expert_bytes, warmup)
        for name in (names() if policies is None else policies)
    ]


def _metrics(
    name: str, steps: list[list[PolicyStep]], expert_bytes: float, warmup: int
) -> dict[str, Any]:
    L, T = len(steps), len(steps[0])
    measured = [[steps[layer][t] for layer in range(L)] for t in range(warmup, T)]
    per_step_LR = [torch.stack([s.load_R for s in layers]) for layers in measured]
    bal = torch.cat([balancedness_per_layer(x) for x in per_step_LR])
    flat = [s for layers in measured for s in layers]
    offered = sum(int(s.alloc_ER.sum()) + s.dropped for s in flat)
    n = len(measured)
    return {
        "policy": name,
        "balancedness_layer_min": float(bal.min()),
        "balancedness_layer_mean": float(bal.mean()),
        "balancedness_summed": sum(balancedness_summed(x) for x in per_step_LR) / n,
        "max_over_mean": sum(imbalance(s.load_R) for s in flat) / len(flat),
        "copies": sum(s.copies for s in flat) / n,
        "new_copies": sum(s.new_copies for s in flat) / n,
        "moved_bytes": sum(s.moved_bytes(expert_bytes) for s in flat) / n,
        "dropped_fraction": sum(s.dropped for s in flat) / offered if offered else 0.0,
    }
