"""The allocations behind the non-exact candidates of ``policy="auto"``.

Legend:
    R ranks, E experts, B slots, M = ceil(E/R), N records in all
    L[r]       static load of rank r (records of its home experts)
    target[r]  records rank r executes under the candidate
    X[r]       L[r] - target[r] (> 0 donor, < 0 receiver)
    cap        ceil(N / R * (1 + eps)), the bound of candidate ``bounded-<eps>``

* ``bounded-<eps>`` (:func:`bounded_targets`): only ranks above ``cap`` shed,
  down to ``cap``; the shed records fill the most underloaded ranks to a common
  level (water-filling), the rest keep their static load. The targets then go
  through the planner's own group-flow construction, so fewer ranks receive and
  fewer copies are made than under exact balance, with the same guarantees
  (one donor group per receiver: at most ``M`` remote experts).
* ``resident`` (:func:`resident_alloc_reference`, :func:`resident_alloc`): the
  static allocation, then records of overloaded ranks' experts move to ranks
  that hold a resident replica of that expert in ``previous``'s slots (no new
  copy), never above the exact target and never below it on the donor.
"""

from __future__ import annotations

import heapq
from fractions import Fraction

import numpy as np
import torch

from moonplan.plan.home import home_list, max_local, targets_list

BOUNDED_PREFIX = "bounded-"


def parse_bounded(name: str) -> Fraction | None:
    """``eps`` of a ``"bounded-<eps>"`` name (exact decimal), ``None`` for other names."""
    if not name.startswith(BOUNDED_PREFIX):
        return None
    try:
        eps = Fraction(name[len(BOUNDED_PREFIX) :])
    except (ValueError, ZeroDivisionError):
        return None
    return eps if eps >= 0 else None


def bounded_name(eps: float | str) -> str:
    """The candidate name of ``eps`` (``0.1 -> "bounded-0.1"``)."""
    return f"{BOUNDED_PREFIX}{float(eps):g}"


def bounded_cap(total: int, num_ranks: int, eps: Fraction) -> int:
    """``cap = ceil(N / R * (1 + eps))`` in exact integer arithmetic."""
    p, q = eps.numerator, eps.denominator
    return -(-total * (q + p) // (q * num_ranks))


def bounded_targets(load: list[int], eps: Fraction) -> tuple[list[int], int]:
    """Per-rank targets of ``bounded-<eps>`` and its cap.

    Ranks above ``cap`` shed down to ``cap``; the shed records ``S`` raise the
    lowest loads to a level ``t`` (the largest with ``sum(max(0, t - L)) <= S``),
    the remainder goes one record each to the lowest-id ranks at or below ``t``.
    Every target is at most ``cap`` (the sum is ``N <= R * cap``), and donors'
    targets (``cap``) are the largest, which is what the group-flow construction
    needs (``moonplan/plan/README.md``). With no rank above ``cap`` the targets
    are the static loads.
    """
    R = len(load)
    cap = bounded_cap(sum(load), R, eps)
    shed = sum(max(0, x - cap) for x in load)
    target = [min(x, cap) for x in load]
    if shed == 0:
        return target, cap
    others = sorted(x for x in load if x <= cap)
    level, used = others[0], 0
    for i, x in enumerate(others):  # raise the i+1 lowest ranks from `level` to `x`
        step = (x - level) * i
        if used + step > shed:
            break
        used, level = used + step, x
    below = [r for r in range(R) if load[r] <= level]
    lift, extra = divmod(shed - used, len(below))
    level += lift
    for r in range(R):
        if load[r] <= cap:
            target[r] = max(load[r], level)
    for r in below[:extra]:
        target[r] += 1
    return target, cap


def resident_alloc_reference(
    counts: list[list[int]], prev_slots: list[list[int]]
) -> list[list[int]]:
    """The ``resident`` allocation ``[E][R]`` (plain Python, the definition).

    Start from static EP. While some resident pair ``(e, r)`` (``e`` in one of
    ``r``'s previous slots, ``r`` not its home ``d``) has ``X[d] > 0``,
    ``X[r] < 0`` and records of ``e`` left on ``d``: take the pair with the
    largest donor excess, then the largest receiver deficit, then the lowest
    ``e``, then the lowest ``r``, and move ``min(X[d], -X[r], alloc[e][d])``
    records of ``e`` from ``d`` to ``r``. A rank starts at most ``M`` remote
    experts (the planner's remote bound).
    """
    R, E = len(counts), len(counts[0])
    home = home_list(E, R)
    M = max_local(E, R)
    T = [sum(row[e] for row in counts) for e in range(E)]
    alloc = [[0] * R for _ in range(E)]
    load = [0] * R
    for e in range(E):
        alloc[e][home[e]] = T[e]
        load[home[e]] += T[e]
    X = [x - t for x, t in zip(load, targets_list(sum(T), R), strict=True)]
    pairs = sorted({(e, r) for r in range(R) for e in prev_slots[r] if e >= 0 and home[e] != r})
    remote = [0] * R
    while True:
        live = [
            (e, r)
            for e, r in pairs
            if X[home[e]] > 0
            and X[r] < 0
            and alloc[e][home[e]] > 0
            and (alloc[e][r] > 0 or remote[r] < M)
        ]
        if not live:
            return alloc
        e, r = min(live, key=lambda p: (-X[home[p[0]]], X[p[1]], p[0], p[1]))
        d = home[e]
        q = min(X[d], -X[r], alloc[e][d])
        remote[r] += alloc[e][r] == 0
        alloc[e][d] -= q
        alloc[e][r] += q
        X[d] -= q
        X[r] += q


def resident_alloc(counts_RE: torch.Tensor, prev_RB: torch.Tensor) -> torch.Tensor:
    """:func:`resident_alloc_reference` on tensors: the same moves, no rescans.

    A pair's key ``(-X[d], X[r], e, r)`` only grows (a donor's excess and a receiver's
    deficit only shrink), and a pair that stops being usable never becomes usable again
    (the records left at home only shrink; a full rank stays full). So the pairs sit in
    a heap under the key they had when filed: the least filed key whose pair's key has
    not grown is the least of all, and a pair whose key grew is filed again. Reads the
    counts on the host (``O(E + R*B)`` integers); returns ``alloc_ER`` on the counts'
    device.
    """
    R, E = counts_RE.shape
    home = home_list(E, R)
    M = max_local(E, R)
    T = counts_RE.sum(0).tolist()
    left = list(T)  # records of e still on its home
    load = [0] * R
    for e in range(E):
        load[home[e]] += T[e]
    X = [x - t for x, t in zip(load, targets_list(sum(T), R), strict=True)]
    pairs = {
        (e, r) for r, row in enumerate(prev_RB.tolist()) for e in row if e >= 0 and home[e] != r
    }
    heap = [(-X[home[e]], X[r], e, r) for e, r in pairs]
    heapq.heapify(heap)
    got: dict[tuple[int, int], int] = {}
    remote = [0] * R
    while heap:
        key = heapq.heappop(heap)
        e, r = key[2], key[3]
        d = home[e]
        if not (X[d] > 0 and X[r] < 0 and left[e] > 0 and ((e, r) in got or remote[r] < M)):
            continue  # dead for good
        if key[:2] != (-X[d], X[r]):
            heapq.heappush(heap, (-X[d], X[r], e, r))  # grown: filed again
            continue
        q = min(X[d], -X[r], left[e])
        if (e, r) not in got:
            remote[r] += 1
        got[(e, r)] = got.get((e, r), 0) + q
        left[e] -= q
        X[d] -= q
        X[r] += q
        heapq.heappush(heap, (-X[d], X[r], e, r))  # it may move again
    alloc_ER = np.zeros((E, R), dtype=np.int64)  # filled on the host: no tensor op a move
    alloc_ER[np.arange(E), home] = left
    for (e, r), q in got.items():
        alloc_ER[e, r] += q
    return torch.from_numpy(alloc_ER).to(counts_RE.device)
