"""Static expert parallelism: every record runs on its expert's only holder (no copies, no drops).

Legend: R ranks, E experts; ``counts_RE`` int64 ``[R, E]``; ``alloc_ER`` int64 ``[E, R]``;
``home_E`` int64 ``[E]`` rank holding each expert.

Two placements, as vLLM offers them (``moonplan/plan/placement.py``, which computes
both): ``static-linear`` (contiguous blocks, moonplan's home map) and
``static-round-robin`` (expert ``e`` on rank ``e mod R``).
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.baselines.policy_base import Policy, PolicyStep, make_step
from moonplan.baselines.registry import PolicyInfo, register
from moonplan.plan import placement
from moonplan.plan.validate import as_counts


def static_alloc(counts: Any) -> torch.Tensor:
    """``alloc [E, R]`` of static EP (linear home map): all of ``T_e`` on ``home(e)``."""
    return placement.static_alloc(as_counts(counts))


def round_robin_alloc(counts: Any) -> torch.Tensor:
    """``alloc [E, R]`` of static EP with the round-robin placement."""
    counts_RE = as_counts(counts)
    R, E = counts_RE.shape
    home_E = placement.placement_home(E, R, "round-robin", device=counts_RE.device)
    return placement.static_alloc(counts_RE, home_E)


def max_over_mean(alloc_ER: torch.Tensor) -> float:
    """Imbalance ``max / mean`` of the records per rank (1.0 when there are none)."""
    load_R = alloc_ER.sum(0).to(torch.float64)
    mean = float(load_R.mean())
    return float(load_R.max()) / mean if mean > 0 else 1.0


class StaticPolicy(Policy):
    """Static EP with ``placement="linear"`` (vLLM's default) or ``"round-robin"``."""

    def __init__(self, num_ranks: int, num_experts: int, placement_name: str = "linear") -> None:
        super().__init__(num_ranks, num_experts)
        self.home_E = placement.placement_home(num_experts, num_ranks, placement_name)
        self.name = f"static-{placement_name}"

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        return make_step(self.name, counts_RE, placement.static_alloc(counts_RE, self.home_E))


def _build(name: str, num_ranks: int, num_experts: int) -> StaticPolicy:
    return StaticPolicy(num_ranks, num_experts, name.removeprefix("static-"))


register(PolicyInfo("static-linear", _build, label="static", order=0))
register(PolicyInfo("static-round-robin", _build, label="rr", order=10))
