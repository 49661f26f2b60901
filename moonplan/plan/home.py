"""The linear home map and per-rank targets.

Legend: R ranks, E experts, M = ceil(E/R) most experts any rank owns.

Rank ``r`` owns a contiguous block of experts; the first ``E mod R`` ranks own
one extra. With ``E < R`` the last ``R - E`` ranks own none.
"""

from __future__ import annotations

import torch

from moonplan.errors import PlanError


def _check_sizes(num_experts: int, num_ranks: int) -> None:
    if not isinstance(num_experts, int) or num_experts < 1:
        raise PlanError(f"num_experts must be an integer >= 1, got {num_experts!r}")
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise PlanError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")


def max_local(num_experts: int, num_ranks: int) -> int:
    """``M = ceil(E/R)``: the most home experts on one rank (and the remote-expert bound)."""
    _check_sizes(num_experts, num_ranks)
    return -(-num_experts // num_ranks)


def home_start(rank: int, num_experts: int, num_ranks: int) -> int:
    """First global expert id owned by ``rank`` (``== E`` past the last owner)."""
    base, extra = divmod(num_experts, num_ranks)
    return rank * base + min(rank, extra)


def home_edges(num_experts: int, num_ranks: int) -> list[int]:
    """``[R + 1]`` group edges: rank ``r`` owns experts ``[edges[r], edges[r + 1])``
    (:func:`home_start` of every rank and of ``R``)."""
    base, extra = divmod(num_experts, num_ranks)
    return [r * base + min(r, extra) for r in range(num_ranks + 1)]


def home_list(num_experts: int, num_ranks: int) -> list[int]:
    """Home rank of every expert, as a Python list of length ``E``."""
    _check_sizes(num_experts, num_ranks)
    base, extra = divmod(num_experts, num_ranks)
    out: list[int] = []
    for r in range(num_ranks):
        out += [r] * (base + (1 if r < extra else 0))
    return out


def home_map(
    num_experts: int, num_ranks: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Home rank of each expert.

    Returns:
        home_E: int64 tensor ``[E]``; ``home_E[e]`` is the rank that owns expert ``e``.
    """
    _check_sizes(num_experts, num_ranks)
    e_E = torch.arange(num_experts, device=device, dtype=torch.int64)
    return home_of(e_E, num_experts, num_ranks)


def home_of(e_E: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """Home rank of the experts ``e_E`` (int64 tensor, any device, values in ``[0, E)``),
    in at most four kernels: the first ``E mod R`` ranks own ``M`` experts each, the
    others ``M - 1``. With ``E < R`` it is ``e_E`` itself (expert ``e`` alone on rank ``e``)."""
    base, extra = divmod(num_experts, num_ranks)
    M = -(-num_experts // num_ranks)
    if extra == 0:
        return e_E // M
    if base == 0:
        return e_E
    cut = extra * M  # experts of the full groups
    return torch.where(e_E < cut, e_E // M, (e_E - extra) // base)


def targets_list(total: int, num_ranks: int) -> list[int]:
    """Records each rank executes: ``N // R``, plus one for the first ``N mod R`` ranks."""
    q, m = divmod(total, num_ranks)
    return [q + (1 if r < m else 0) for r in range(num_ranks)]
