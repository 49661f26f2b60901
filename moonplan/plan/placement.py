"""Static expert placement: which rank holds each expert, and the allocation and load it gives.

Legend:
    R ranks    E experts
    home_E     int64 ``[E]`` rank holding expert ``e``'s weights
    counts_RE  int64 ``[R, E]`` records source rank ``s`` routes to expert ``e``
    alloc_ER   int64 ``[E, R]`` records of expert ``e`` that rank ``r`` executes
    load_R     int64 ``[R]`` records rank ``r`` executes

Two placements (vLLM names them the same way):

* ``"linear"``: contiguous blocks, the first ``E mod R`` ranks own one more
  (:func:`moonplan.plan.home.home_map`, moonplan's home map);
* ``"round-robin"``: interleaved, expert ``e`` on rank ``e mod R`` (with ``E = 4``
  and ``R = 2`` rank 0 owns experts 0 and 2), which spreads neighbouring experts.

Static EP runs every record on its expert's holder. This module is the one place
that computes it: the static plan (``moonplan/plan/static.py``), the planner's
``"static"`` candidate, ``Plan.static_load`` and the simulator's static and capacity
baselines all call :func:`static_alloc` or :func:`static_load`. Both functions keep
the counts' device and, with the default linear placement, read nothing on the host.
"""

from __future__ import annotations

import torch

from moonplan.plan.home import home_map

PLACEMENTS = ("linear", "round-robin")
"""Names :func:`placement_home` understands."""


def placement_home(
    num_experts: int,
    num_ranks: int,
    placement: str = "linear",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``home_E`` (int64 ``[E]`` on ``device``) of the named placement (see the module doc)."""
    if placement == "linear":
        return home_map(num_experts, num_ranks, device=device)
    if placement == "round-robin":
        return round_robin_home(num_experts, num_ranks, device=device)
    raise ValueError(f"unknown placement {placement!r}; use one of {PLACEMENTS}")


def round_robin_home(
    num_experts: int, num_ranks: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """``home_E`` of the round-robin placement: expert ``e`` on rank ``e mod R`` (int64 ``[E]``)."""
    if num_experts < 1 or num_ranks < 1:
        raise ValueError(f"need experts >= 1 and ranks >= 1, got {num_experts}, {num_ranks}")
    return torch.arange(num_experts, dtype=torch.int64, device=device) % num_ranks


def _home(counts_RE: torch.Tensor, home_E: torch.Tensor | None) -> torch.Tensor:
    """``home_E`` on the counts' device: the linear map when ``None``, else checked."""
    R, E = counts_RE.shape
    if home_E is None:
        return home_map(E, R, device=counts_RE.device)
    if home_E.shape != (E,) or int(home_E.min()) < 0 or int(home_E.max()) >= R:
        raise ValueError(f"home_E must be [E={E}] ranks in [0, {R}), got {home_E.tolist()}")
    return home_E.to(device=counts_RE.device, dtype=torch.int64)


def static_alloc(counts_RE: torch.Tensor, home_E: torch.Tensor | None = None) -> torch.Tensor:
    """``alloc_ER`` of static EP: every expert's records ``sum_s counts[s, e]`` on ``home_E[e]``.

    Args:
        counts_RE: int64 ``[R, E]`` counts (any device).
        home_E: int64 ``[E]`` placement (default: the linear home map; a given one is
            checked on the host).

    Returns:
        int64 ``[E, R]`` on the counts' device.
    """
    R, E = counts_RE.shape
    dev = counts_RE.device
    alloc_ER = torch.zeros(E, R, dtype=torch.int64, device=dev)
    at = (torch.arange(E, device=dev), _home(counts_RE, home_E))
    return alloc_ER.index_put(at, counts_RE.sum(0))  # out of place: torch.vmap batches it


def static_load(counts_RE: torch.Tensor, home_E: torch.Tensor | None = None) -> torch.Tensor:
    """``load_R`` of static EP (int64 ``[R]`` on the counts' device): ``static_alloc(...).sum(0)``
    without building the ``[E, R]`` allocation."""
    load_R = torch.zeros(counts_RE.shape[0], dtype=torch.int64, device=counts_RE.device)
    return load_R.index_add_(0, _home(counts_RE, home_E), counts_RE.sum(0).to(torch.int64))
