"""Whether a home order from the window's loads is predicted to serve it faster.

Legend:
    R ranks    E experts    B slots per rank    S the window's steps
    loads_SE   int64 ``[S, E]`` records per step and expert label (the window's)
    perm_E     a permutation of the labels: new label ``j`` is old label ``perm_E[j]``

:func:`~moonplan.plan.home_order.popular_order` spreads the window's heavy experts over
the ranks, which lowers static EP's busiest rank. Whether that makes the steps faster
depends on how they are served: with slots that stay, replicas already absorb much of
the imbalance, and a new order puts other experts together. So the order is taken only
where the cost model predicts the window's steps faster under it
(:func:`judged_order`). Both maps are scored alike, from empty slots, as a re-home
empties the slots: :func:`~moonplan.plan.residency.target.target_of`'s table and way of
least predicted time, or for steps whose slots go stale (training)
:func:`~moonplan.plan.residency.target.stale_way`. No threshold enters; what a re-home
costs once (its rows' moves) is for the caller, who calls it once, to weigh.
"""

from __future__ import annotations

import torch

from moonplan.plan.home_order import popular_order
from moonplan.plan.residency.serving import empty_slots
from moonplan.plan.residency.target import stale_way, target_of, window_rows
from moonplan.plan.residency.work import Builds
from moonplan.stepcost import StepCost


def window_best_s(
    cost: StepCost,
    loads_SE: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    stale: bool = False,
    builds: Builds | None = None,
) -> float:
    """The least predicted seconds of the window's steps under the labels' linear home
    map, from empty slots (module docstring): the best table and way, or where the slots
    go stale (or there are none) the best way of such steps."""
    S = loads_SE.shape[0]
    totals_E = loads_SE.sum(0).cpu()
    if stale or num_slots == 0:
        rows_SRE = window_rows(totals_E, S, num_ranks, loads_SE)
        return stale_way(cost, rows_SRE, num_slots, loads_SE, builds)[0]
    empty_RB = empty_slots(num_ranks, num_slots)
    return target_of(totals_E, S, empty_RB, cost, loads_SE, builds).seconds


def judged_order(
    cost: StepCost,
    loads_SE: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    stale: bool = False,
    builds: Builds | None = None,
) -> list[int] | None:
    """``perm_E``: :func:`popular_order` of the window's loads (its groups kept on the
    ranks that own most of them), where the window's steps are predicted faster under it
    than under the labels as they are (:func:`window_best_s`, both); else ``None`` (also
    for an empty window and where the order is the identity)."""
    E = loads_SE.shape[1]
    if loads_SE.shape[0] == 0:
        return None
    identity = list(range(E))
    perm_E = popular_order(loads_SE.sum(0), num_ranks, identity)
    if perm_E == identity:
        return None
    perm = torch.tensor(perm_E, dtype=torch.int64, device=loads_SE.device)
    now = window_best_s(cost, loads_SE, num_ranks, num_slots, stale, builds)
    after = window_best_s(cost, loads_SE[:, perm], num_ranks, num_slots, stale, builds)
    return perm_E if after < now else None
