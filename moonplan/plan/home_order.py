"""A home order from popularity: which experts each rank owns, chosen from their loads.

Legend:
    R ranks    E experts    M = ceil(E/R)
    load_E     ``[E]`` each expert's load (records over a window of steps, any real dtype)
    order_E    the experts in home order: rank ``r`` owns ``order_E[edges[r]:edges[r + 1]]``
               (``edges = home.home_edges(E, R)``: the linear map's block sizes)

moonplan's planner, residency and runtime label experts so that the linear home map
(:mod:`moonplan.plan.home`) holds: rank ``r`` owns a contiguous block of labels. A home
order relabels the model's experts: label ``i`` is model expert ``order_E[i]``. The
identity order is the linear map; another order puts any experts together on a rank.

Why: a trained model's hot experts need not be spread over the index blocks. On the
recorded traces (``moonplan.traces.real``) the linear map puts several of them on one
rank; ``bench/bench_auto_sweep.py`` measures auto with and without an order from the
warm-up's loads (``moonplan-auto-ordered``, docs/benchmarks.md).

The rule (:func:`popular_order`) is greedy largest-first (LPT) under the block sizes:
each expert, heaviest first, goes to the least loaded rank that still has room. Every
rank ends with its block's count of experts, so the order is a permutation. Measured,
not proven (``tests/plan/test_home_order.py``, hypothesis): the busiest rank stays
within the heaviest expert of the mean, and within 1.5x of the exhaustive optimum on
inputs of up to 7 experts (the 1.5x: three equal experts in blocks of two and one).
"""

from __future__ import annotations

import numpy as np
import torch

from moonplan.errors import PlanError
from moonplan.plan.home import home_edges


def popular_order(
    load_E: torch.Tensor, num_ranks: int, current: list[int] | None = None
) -> list[int]:
    """``order_E``: the experts in home order, from their loads (module docstring).

    Args:
        load_E: ``[E]`` finite, non-negative loads (int or float, any device; read once).
        num_ranks: ``R >= 1``.
        current: the home order now (a permutation of the ``E`` experts), or ``None``.
            Given, the greedy's groups go to the ranks that already own most of their
            experts (:func:`kept_blocks`), so re-homing moves fewer rows for the same
            busiest rank.

    Returns:
        A permutation of ``0 .. E-1`` as a Python list; rank ``r``'s experts ascending
        within its block (with ``current``: in their current order, so that a rank that
        keeps its experts keeps its rows as they are). Ties go to the lower expert id and
        the lower rank, so every rank computes the same order from the same loads.
    """
    loads = _checked(load_E, num_ranks)
    E = len(loads)
    edges = home_edges(E, num_ranks)
    room_R = [edges[r + 1] - edges[r] for r in range(num_ranks)]
    total_R = [0.0] * num_ranks
    owned_R: list[list[int]] = [[] for _ in range(num_ranks)]
    for e in sorted(range(E), key=lambda e: (-loads[e], e)):
        r = min((r for r in range(num_ranks) if len(owned_R[r]) < room_R[r]),
                key=lambda r: (total_R[r], r))  # fmt: skip
        owned_R[r].append(e)
        total_R[r] += loads[e]
    if current is None:
        return [e for r in range(num_ranks) for e in sorted(owned_R[r])]
    now = check_order(current, E)
    label_E = label_of(now)  # each expert's place in the current order
    owned_R = kept_blocks(owned_R, now, edges)
    return [e for r in range(num_ranks) for e in sorted(owned_R[r], key=label_E.__getitem__)]


def kept_blocks(groups_R: list[list[int]], current: list[int], edges: list[int]) -> list[list[int]]:
    """``groups_R`` given to ranks so that few experts change rank: the groups (each of
    its rank's block size) are matched to the ranks of the same block size, the pair
    sharing the most experts with the rank's ``current`` block first (ties: lower group,
    then lower rank). Greedy: it keeps at least half of what the best matching keeps.
    Every rank's load is one group's, so the busiest rank is unchanged."""
    R = len(groups_R)
    owned = [set(current[edges[r] : edges[r + 1]]) for r in range(R)]
    pairs = sorted(
        (-len(owned[r] & set(groups_R[g])), g, r)
        for g in range(R)
        for r in range(R)
        if len(groups_R[g]) == edges[r + 1] - edges[r]
    )
    out: dict[int, list[int]] = {}
    used: set[int] = set()
    for _, g, r in pairs:
        if g not in used and r not in out:
            out[r] = groups_R[g]
            used.add(g)
    return [out[r] for r in range(R)]  # every rank matched: the sizes are the blocks'


def check_order(order: object, num_experts: int | None) -> list[int]:
    """``order`` as a list of ints if it is a permutation of ``0 .. E-1`` (of its own
    length where ``num_experts`` is ``None``), else a ``PlanError`` that says what is
    wrong. Takes a list, tuple, range, tensor or NumPy array of ints."""
    if isinstance(order, range):
        order = list(order)
    elif isinstance(order, (torch.Tensor, np.ndarray)):
        order = order.tolist()
    if not isinstance(order, (list, tuple)) or not all(
        isinstance(e, int) and not isinstance(e, bool) for e in order
    ):
        raise PlanError(f"home_order must be a sequence of expert ids, got {order!r}")
    n = len(order) if num_experts is None else num_experts
    if sorted(order) != list(range(n)):
        raise PlanError(
            f"home_order must hold each of the {n} experts once, got "
            f"{len(order)} ids {_short(list(order))}"
        )
    return list(order)


def label_of(order: list[int]) -> list[int]:
    """The inverse permutation: ``label_of(order)[order[i]] == i`` (model id -> label)."""
    out = [0] * len(order)
    for i, e in enumerate(order):
        out[e] = i
    return out


def _checked(load_E: torch.Tensor, num_ranks: int) -> list[float]:
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise PlanError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
    if not isinstance(load_E, torch.Tensor) or load_E.dim() != 1 or load_E.numel() < 1:
        got = tuple(load_E.shape) if isinstance(load_E, torch.Tensor) else type(load_E).__name__
        raise PlanError(f"load_E must be a 1-D tensor of per-expert loads, got {got}")
    if load_E.is_complex() or load_E.dtype == torch.bool:
        raise PlanError(f"load_E must be real numbers, got dtype {load_E.dtype}")
    loads = load_E.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(loads).all()) or bool((loads < 0).any()):
        raise PlanError(f"load_E must be finite and >= 0, got {_short(loads.tolist())}")
    return loads.tolist()


def _short(values: list) -> str:
    return str(values) if len(values) <= 8 else f"{values[:8]} ..."
