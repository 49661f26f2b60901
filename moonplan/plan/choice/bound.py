"""``auto``'s early exit: a bound that every candidate but ``static`` meets, from the counts.

Legend:
    R ranks    E experts    G ranks per fast-link domain    N records in all
    T[e]       records of expert e        tile(x)  x rounded up to ``tile_rows``
    lat        ``base_latency_s + per_peer_latency_s * (R - 1)`` (0 with one rank)

When static EP's predicted time, charged only the test (``StepCost.exit_s``), is at most
this bound, no candidate can beat it even before its own planning (``StepCost.plan_s``)
is added: ``auto`` returns the static plan and builds nothing. The bound takes the least
of two, one per way a candidate can differ from static EP:

* **it copies weights** (a replica not resident): the step waits at least for one copy
  (``base_latency_s`` plus the cheapest copy over a link class the group has), and for
  the dispatch, a balanced experts phase and the combine:
  ``plan_s + max(lat + experts_lb, base + copy_min) + lat`` (overlapped schedule;
  serially the copy is added to the rest). With the overlapped schedule a copy reads its
  expert's weights beside the sender's home rows (``StepCost``): a home expert with
  records and no resident replica elsewhere costs its home rank one weight read whether
  its rows stay or are copied away, so the experts phase is also at least
  ``weight_read_s`` times the most such experts on one rank;
* **it copies nothing** (static EP built in the full call among them): it only moves
  records to replicas resident in ``previous``'s slots, so an expert with no resident
  replica keeps all its records at home, and every rank runs at least those:
  ``plan_s + lat + max(experts_lb, home_lb) + lat``. With no resident replica at all the
  only such plan is static EP itself, and the bound is its time charged ``plan_s``.

``experts_lb`` bounds the slowest rank's experts phase in any plan, from two facts. The
ranks' padded rows add up to at least ``sum_e tile(T[e])`` (padding a split expert never
pads less), and their weight reads and rows to at least ``weight_read_s * Z + row_mem_s *
N``, ``Z`` the experts with records: the slowest rank is at least the mean of each. And
every expert with records runs on some rank, so some rank runs at least ``k = ceil(Z / R)``
of them, each at least one tile and one row: ``k * tile_rows`` padded rows and
``k * (weight_read_s + row_mem_s)`` of weight reads and rows. At decode sizes, where
every rank reads about ``E / R`` experts' weights, the second fact is the tight one.
``home_lb`` is the
largest roofline, over ranks, of their home experts that have no resident replica. Every
term is a non-negative product of a rate and an integer, a ``max``, a mean or a sum; in
real arithmetic each is at most the candidate's own term, and adding them in another order
than the step-cost formula changes a sum by a few units in its last place (``2**-52``
relative), so the bound is scaled by ``1 - 2**-40`` (:data:`MARGIN`) and never exceeds a
candidate's predicted time (``tests/plan/choice/test_bound.py`` checks it against every
candidate).

Two forms with equal results: plain Python (the definition, :func:`exit_bound`) and
torch (any device, no host read, :func:`exit_bound_torch`).
"""

from __future__ import annotations

import math

import torch

from moonplan.stepcost.step_cost import StepCost

MARGIN = 1.0 - 2.0**-40
"""The bound is scaled by this: room for rounding (a few ``2**-52``), not a tuning."""


def copy_min_s(cost: StepCost, num_ranks: int) -> float:
    """Seconds of the cheapest single weight copy the group can make (``inf``: none)."""
    G = cost.domain_size(num_ranks)
    near = cost.copy_s_intra if G >= 2 else math.inf
    far = cost.copy_s_inter if num_ranks > G else math.inf
    return min(near, far)


def exit_bound(
    cost: StepCost,
    num_ranks: int,
    totals: tuple[int, int, int, int],
    home_lb: float,
    static_full: float | None,
) -> float:
    """The bound of the module docstring (``inf`` with one rank).

    Args:
        cost: the model.
        num_ranks: ``R``.
        totals: ``(sum_e tile(T[e]), experts with records, N, the most home experts
            with records and no resident replica elsewhere on one rank)``.
        home_lb: ``home_lb`` seconds.
        static_full: static EP's time charged ``plan_s`` when ``previous`` holds no
            resident replica (the only copy-free plan), else ``None``.
    """
    R = num_ranks
    if R <= 1:
        return math.inf
    tiles, busy, N, kept = totals
    lat = cost.base_latency_s + cost.per_peer_latency_s * (R - 1)
    k = -(-busy // R)
    flop_lb = max(-(-tiles // R), k * cost.tile_rows) * cost.row_flop_s
    mem_lb = (busy * cost.weight_read_s + N * cost.row_mem_s) / R
    experts_lb = max(flop_lb, mem_lb, k * cost.weight_read_s + k * cost.row_mem_s)
    wait = cost.base_latency_s + copy_min_s(cost, R)
    if cost.overlap:
        reads = max(experts_lb, kept * cost.weight_read_s)
        copying = cost.plan_s + max(lat + reads, wait) + lat
    else:
        copying = cost.plan_s + lat + experts_lb + lat + wait
    free = cost.plan_s + lat + max(experts_lb, home_lb) + lat
    return min(copying, free if static_full is None else static_full) * MARGIN


def exit_bound_torch(
    cost: StepCost,
    num_ranks: int,
    totals: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    home_lb: torch.Tensor,
    static_full: torch.Tensor,
    resident: torch.Tensor,
) -> torch.Tensor:
    """float64 0-d: :func:`exit_bound` with tensor inputs (int64 0-d ``totals``, float64
    0-d ``home_lb`` and ``static_full``, bool 0-d ``resident``: ``previous`` holds a
    resident replica)."""
    R = num_ranks
    tiles, busy, N, kept = totals
    inf = torch.full((), math.inf, dtype=torch.float64, device=tiles.device)
    if R <= 1:
        return inf
    lat = cost.base_latency_s + cost.per_peer_latency_s * (R - 1)
    k = (busy + (R - 1)) // R
    flop_lb = torch.maximum((tiles + (R - 1)) // R, k * cost.tile_rows)
    flop_lb = flop_lb.to(torch.float64) * cost.row_flop_s
    mem_lb = busy.to(torch.float64) * cost.weight_read_s + N.to(torch.float64) * cost.row_mem_s
    k_f = k.to(torch.float64)
    per_k = k_f * cost.weight_read_s + k_f * cost.row_mem_s
    experts_lb = torch.maximum(torch.maximum(flop_lb, mem_lb / R), per_k)
    wait = cost.base_latency_s + copy_min_s(cost, R)
    if cost.overlap:
        reads = torch.maximum(experts_lb, kept.to(torch.float64) * cost.weight_read_s)
        copying = cost.plan_s + torch.clamp(lat + reads, min=wait) + lat
    else:
        copying = cost.plan_s + lat + experts_lb + lat + wait
    free = cost.plan_s + lat + torch.maximum(experts_lb, home_lb) + lat
    return torch.minimum(copying, torch.where(resident, free, static_full)) * MARGIN
