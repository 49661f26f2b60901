"""Static placements other than the linear home map, and allocation under any placement.

Legend: R ranks, E experts; ``home_E`` int64 ``[E]`` rank holding each expert;
``counts_RE`` int64 ``[R, E]``; ``alloc_ER`` int64 ``[E, R]``.

vLLM offers two static expert placements: ``linear`` (contiguous blocks; the same
as moonplan's home map, the first ``E mod R`` ranks own one more) and
``round_robin`` (interleaved: expert ``e`` on rank ``e mod R``, so with ``E = 4``
and ``R = 2`` rank 0 owns experts 0 and 2). Round-robin spreads neighbouring
experts, which helps when popular experts have nearby ids.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.plan.validate import as_counts


def round_robin_home(num_experts: int, num_ranks: int) -> torch.Tensor:
    """``home_E`` of the round-robin placement: expert ``e`` on rank ``e mod R`` (int64 ``[E]``)."""
    if num_experts < 1 or num_ranks < 1:
        raise ValueError(f"need experts >= 1 and ranks >= 1, got {num_experts}, {num_ranks}")
    return torch.arange(num_experts, dtype=torch.int64) % num_ranks


def placement_alloc(counts: Any, home_E: torch.Tensor) -> torch.Tensor:
    """``alloc [E, R]`` when every record of expert ``e`` runs on ``home_E[e]`` (CPU int64)."""
    counts_RE = as_counts(counts).cpu()
    R, E = counts_RE.shape
    if home_E.shape != (E,) or int(home_E.min()) < 0 or int(home_E.max()) >= R:
        raise ValueError(f"home_E must be [E={E}] ranks in [0, {R}), got {home_E.tolist()}")
    alloc_ER = torch.zeros(E, R, dtype=torch.int64)
    alloc_ER[torch.arange(E), home_E.cpu()] = counts_RE.sum(0)
    return alloc_ER


def round_robin_alloc(counts: Any) -> torch.Tensor:
    """``alloc [E, R]`` of static EP with the round-robin placement (CPU int64)."""
    counts_RE = as_counts(counts).cpu()
    R, E = counts_RE.shape
    return placement_alloc(counts_RE, round_robin_home(E, R))
