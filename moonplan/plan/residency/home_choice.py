"""Whether a home order from the window's loads is predicted to serve it faster.

Legend:
    R ranks    E experts    B slots per rank    S the window's steps
    loads_SE   int64 ``[S, E]`` records per step and expert label (the window's)
    perm_E     a permutation of the labels: new label ``j`` is old label ``perm_E[j]``

:func:`~moonplan.plan.home_order.popular_order` spreads the window's heavy experts over
the ranks, which lowers static EP's busiest rank. Whether the steps get faster depends on
how they are served, so the order is taken only where the cost model predicts the
window's steps faster under it (:func:`judged_order`).

Both maps are judged on what the map alone gives (:func:`map_s`): the steps served with
no slot kept from one step to the next (static EP, a planner call from empty slots, or
the exact kernel from empty slots: :func:`~moonplan.plan.residency.target.stale_way`). A
re-home leaves the slots empty, and under either map a slot table arrives only through
decisions and refills, which lag (on decode-sized steps one decision counts more steps
of work than a recorded trace's warm-up). Judged by each map's best table instead, the
order was turned down at two recorded points where it then ran 13% and 3% faster than
auto on the linear map (docs/benchmarks.md, "Re-homing"). No threshold enters; what a
re-home costs once (its rows' moves) is for its caller, who calls it once, to weigh.
"""

from __future__ import annotations

import torch

from moonplan.plan.home_order import popular_order
from moonplan.plan.residency.target import stale_way, window_rows
from moonplan.plan.residency.work import Builds
from moonplan.stepcost import StepCost


def map_s(
    cost: StepCost,
    loads_SE: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    builds: Builds | None = None,
) -> float:
    """The least predicted seconds of the window's steps under the labels' linear home
    map with no slot kept between steps (module docstring)."""
    S = loads_SE.shape[0]
    rows_SRE = window_rows(loads_SE.sum(0).cpu(), S, num_ranks, loads_SE)
    return stale_way(cost, rows_SRE, num_slots, loads_SE, builds)[0]


def judged_order(
    cost: StepCost,
    loads_SE: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    builds: Builds | None = None,
) -> list[int] | None:
    """``perm_E``: :func:`popular_order` of the window's loads (its groups kept on the
    ranks that own most of them), where :func:`map_s` predicts the window's steps faster
    under it than under the labels as they are; else ``None`` (also for an empty window
    and where the order is the identity)."""
    E = loads_SE.shape[1]
    if loads_SE.shape[0] == 0:
        return None
    identity = list(range(E))
    perm_E = popular_order(loads_SE.sum(0), num_ranks, identity)
    if perm_E == identity:
        return None
    perm = torch.tensor(perm_E, dtype=torch.int64, device=loads_SE.device)
    now = map_s(cost, loads_SE, num_ranks, num_slots, builds)
    after = map_s(cost, loads_SE[:, perm], num_ranks, num_slots, builds)
    return perm_E if after < now else None
