"""Static expert parallelism: every record runs on its expert's home rank.

Legend: R ranks, E experts.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.plan.home import home_map
from moonplan.plan.validate import as_counts


def static_alloc(counts: Any) -> torch.Tensor:
    """``alloc [E, R]`` of static EP (linear home map): all of ``T_e`` on ``home(e)``."""
    counts_RE = as_counts(counts)
    R, E = counts_RE.shape
    alloc_ER = torch.zeros(E, R, dtype=torch.int64, device=counts_RE.device)
    home_E = home_map(E, R, device=counts_RE.device)
    alloc_ER[torch.arange(E, device=counts_RE.device), home_E] = counts_RE.sum(0)
    return alloc_ER


def max_over_mean(alloc_ER: torch.Tensor) -> float:
    """Imbalance ``max / mean`` of the records per rank (1.0 when there are none)."""
    load_R = alloc_ER.sum(0).to(torch.float64)
    mean = float(load_R.mean())
    return float(load_R.max()) / mean if mean > 0 else 1.0
