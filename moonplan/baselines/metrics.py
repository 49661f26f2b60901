"""Load-balance metrics users expect in EP reports, on the same definitions for every policy.

Legend:
    R ranks    E experts    L MoE layers    T steps
    load_R   records executed per rank (one layer, one step)
    load_LR  records per rank for each of ``L`` layers (or steps)

Definitions (the metrics users expect; see docs/simulator.md, "Metrics"):

* **balancedness** = mean / max records per rank (vLLM and SGLang log it;
  1 is perfect); over layers, vLLM reports the *summed* form
  ``sum_l mean_l / sum_l max_l``, which weights heavy layers more;
* **imbalance** = max / mean (``max_over_mean``); **MaxVio** = max / mean - 1;
* expert MaxVio = max / mean of the *per-expert* totals, minus 1 (the skew of
  the router itself, before any placement);
* copies, new copies and moved (prefetched) bytes per step, dropped records.

All ratios of an empty load (no records) are 1.0 (balanced), and MaxVio 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moonplan.baselines.policy_base import PolicyStep


def _f64(x: Any) -> torch.Tensor:
    return torch.as_tensor(x).to(torch.float64).cpu()


def balancedness(load_R: Any) -> float:
    """mean / max of the records per rank (float in ``(0, 1]``; 1.0 when all are zero)."""
    load = _f64(load_R)
    top = float(load.max())
    return float(load.mean()) / top if top > 0 else 1.0


def imbalance(load_R: Any) -> float:
    """max / mean of the records per rank (float ``>= 1``; 1.0 when all are zero)."""
    load = _f64(load_R)
    mean = float(load.mean())
    return float(load.max()) / mean if mean > 0 else 1.0


def maxvio(load_R: Any) -> float:
    """``imbalance - 1`` (0 when perfectly balanced)."""
    return imbalance(load_R) - 1.0


def expert_maxvio(counts: Any) -> float:
    """MaxVio of the per-expert totals of ``counts [R, E]`` (or of a ``[E]`` vector)."""
    c = _f64(counts)
    total_E = c.sum(0) if c.dim() == 2 else c
    return maxvio(total_E)


def balancedness_per_layer(load_LR: Any) -> torch.Tensor:
    """float64 ``[L]``: mean / max per layer (1.0 for an empty layer)."""
    load = _f64(load_LR)
    top_L = load.max(1).values
    return torch.where(top_L > 0, load.mean(1) / top_L.clamp(min=1e-300), torch.ones_like(top_L))


def balancedness_summed(load_LR: Any) -> float:
    """``sum_l mean_l / sum_l max_l`` over layers, as vLLM logs it (1.0 when empty)."""
    load = _f64(load_LR)
    top = float(load.max(1).values.sum())
    return float(load.mean(1).sum()) / top if top > 0 else 1.0


def step_metrics(step: PolicyStep, expert_bytes: float = 0.0) -> dict[str, float]:
    """Metrics of one policy step (floats): balancedness, imbalance, copies, new copies,
    moved bytes (``new_copies * expert_bytes``), dropped records and their fraction."""
    load_R = step.load_R
    offered = int(step.alloc_ER.sum()) + step.dropped
    return {
        "balancedness": balancedness(load_R),
        "max_over_mean": imbalance(load_R),
        "copies": float(step.copies),
        "new_copies": float(step.new_copies),
        "moved_bytes": step.moved_bytes(expert_bytes),
        "dropped": float(step.dropped),
        "dropped_fraction": step.dropped / offered if offered else 0.0,
    }


def summarize(steps: Sequence[PolicyStep], expert_bytes: float = 0.0) -> dict[str, float]:
    """Means over steps of :func:`step_metrics`, plus the summed balancedness over the steps
    (each step treated as a layer) and the worst step's balancedness."""
    if not steps:
        raise ValueError("summarize needs at least one step")
    rows = [step_metrics(s, expert_bytes) for s in steps]
    out = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    load_TR = torch.stack([s.load_R for s in steps])
    out["balancedness_summed"] = balancedness_summed(load_TR)
    out["balancedness_min"] = float(balancedness_per_layer(load_TR).min())
    return out
