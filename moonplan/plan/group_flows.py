"""Step 1 (group balancing) over host integers, in ``O(log R)`` per flow.

Legend: R ranks; ``X[r] = load[r] - target[r]`` (> 0 donor, < 0 receiver).

Same flows, in the same order, as ``reference.balance_groups`` (which spends
``O(R)`` per flow, or ``O(R^2)`` with resident pairs, for readability). The
torch backend uses this scan for CPU tensors, where reading values costs
nothing and a Python step is cheaper than a tensor op.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moonplan.plan.reference import Flow, keep_previous_flows

if TYPE_CHECKING:
    import torch


def warm_maps(
    prev_RB: torch.Tensor | None, home: list[int]
) -> tuple[dict[int, set[int]] | None, dict[int, dict[int, list[int]]]]:
    """``previous``'s residents as the host scans read them: receiver -> donor groups
    resident there (``None`` without ``prev_RB``), and group -> receiver -> experts."""
    if prev_RB is None:
        return None, {}
    warm: dict[int, set[int]] = {}
    warm_experts: dict[int, dict[int, list[int]]] = {}
    for r, row in enumerate(prev_RB.tolist()):
        for e in sorted(x for x in row if x >= 0):
            warm.setdefault(r, set()).add(home[e])
            warm_experts.setdefault(home[e], {}).setdefault(r, []).append(e)
    return warm, warm_experts


def host_flows(
    load: list[int],
    target: list[int],
    warm_by_receiver: dict[int, set[int]] | None,
    previous: list[Flow],
) -> list[Flow]:
    """Step 1's group flows ``(donor, receiver, records)`` in decision order, on the host:
    ``reference.balance_groups``'s (same rule, ties and order).

    The flows every backend's plan records (``plan.flow``): ``O(R log R)`` integer work,
    no expert is touched (``moonplan.plan.screen`` bounds candidates with it).

    Args:
        load: static load per rank.
        target: records each rank should execute.
        warm_by_receiver: for each receiver, the donor groups resident in its slots
            (:func:`warm_maps`).
        previous: last step's flows in order (``reference.previous_flows``; replayed
            first where they fit).
    """
    X = [x - t for x, t in zip(load, target, strict=True)]  # > 0 donor, < 0 receiver
    flows = keep_previous_flows(load, X, previous, set())
    donors = [(-x, r) for r, x in enumerate(X) if x > 0]  # heap: largest excess, lowest rank
    heapq.heapify(donors)
    receivers = sorted((x, r) for r, x in enumerate(X) if x < 0)  # most negative first
    while receivers:
        pick = _warm_pick(X, receivers, warm_by_receiver) if warm_by_receiver else None
        if pick is None:
            while -donors[0][0] != X[donors[0][1]]:  # drop stale heap entries
                heapq.heappop(donors)
            d, (x_r, r) = donors[0][1], receivers[0]
        else:
            d, (x_r, r) = pick
        flows.append((d, r, -x_r))
        receivers.remove((x_r, r))
        _move(X, donors, receivers, d, r, -x_r)
    return flows


def _move(
    X: list[int],
    donors: list[tuple[int, int]],
    receivers: list[tuple[int, int]],
    d: int,
    r: int,
    q: int,
) -> None:
    """Donor ``d`` gives receiver ``r`` its whole deficit ``q``; re-file the donor."""
    X[r] = 0
    X[d] -= q
    if X[d] > 0:
        heapq.heappush(donors, (-X[d], d))
    elif X[d] < 0:
        bisect.insort(receivers, (X[d], d))


def _warm_pick(
    X: list[int], receivers: list[tuple[int, int]], warm: dict[int, set[int]]
) -> tuple[int, tuple[int, int]] | None:
    """The warm pair with the largest deficit, then largest excess, then lowest ids."""
    best: tuple[int, int, int] | None = None  # (-X[d], r, d)
    level = None
    for x_r, r in receivers:
        if level is not None and x_r != level:
            break
        for d in warm.get(r, ()):
            if X[d] > 0 and (best is None or (-X[d], r, d) < best):
                best, level = (-X[d], r, d), x_r
    if best is None or level is None:
        return None
    return best[2], (level, best[1])


def split_group_host(
    experts: Iterable[int],
    remaining: list[int],
    dests: list[tuple[int, int]],
    warm_experts: dict[int, list[int]],
) -> list[tuple[int, int, int]]:
    """Step 2 for one donor group as ``reference.split_group`` (same moves, same order).

    Heaps replace the reference's scans: destinations by (largest quota, lowest
    rank), experts by (most remaining, lowest id) with stale entries skipped.

    Args:
        experts: the group's expert ids.
        remaining: records per expert still unassigned (updated in place).
        dests: ``(rank, quota)`` outflows of this group.
        warm_experts: for a destination rank, this group's experts resident there.
    """
    push, pop = heapq.heappush, heapq.heappop
    quota_heap = [(-q, r) for r, q in dests]
    heapq.heapify(quota_heap)
    pool = [(-remaining[e], e) for e in experts if remaining[e] > 0]
    heapq.heapify(pool)
    moves: list[tuple[int, int, int]] = []
    while quota_heap:
        neg_q, r = pop(quota_heap)
        warm = warm_experts.get(r)
        if warm and any(remaining[e] > 0 for e in warm):
            e = max((k for k in warm if remaining[k] > 0), key=lambda k: (remaining[k], -k))
        else:
            while -pool[0][0] != remaining[pool[0][1]]:  # drop stale entries
                pop(pool)
            e = pool[0][1]
        left = remaining[e]
        take = min(-neg_q, left)
        moves.append((e, r, take))
        remaining[e] = left - take
        if left > take:
            push(pool, (take - left, e))
        if -neg_q > take:
            push(quota_heap, (neg_q + take, r))
    return moves


@dataclass(frozen=True)
class HostMoves:
    """Steps 1-2 on the host as decided: the group flows in decision order, the moves
    ``(expert, rank, records)`` away from home (each ``(expert, rank)`` once: after a move
    the rank's quota or the expert's records are spent, and an expert belongs to one
    group) and the records left at home per expert."""

    flows: list[Flow]
    moves: list[tuple[int, int, int]]
    remaining: list[int]

    def alloc(self, edges: list[int]) -> np.ndarray:
        """int64 numpy ``[E, R]``: the moves, and what is left at home (``edges`` as
        :func:`host_moves`')."""
        E, R = len(self.remaining), len(edges) - 1
        alloc_ER = np.zeros((E, R), dtype=np.int64)
        if self.moves:
            e_X, r_X, q_X = np.array(self.moves, dtype=np.int64).T
            alloc_ER[e_X, r_X] = q_X
        home_E = np.repeat(np.arange(R, dtype=np.int64), np.diff(np.asarray(edges)))
        alloc_ER[np.arange(E), home_E] = self.remaining  # no move went home
        return alloc_ER


def host_moves(
    load: list[int],
    target: list[int],
    total_E: list[int],
    edges: list[int],
    warm: tuple[dict[int, set[int]] | None, dict[int, dict[int, list[int]]]],
    previous: list[Flow],
) -> HostMoves:
    """Steps 1-2 on the host: the group flows (:func:`host_flows`) and the moves they
    split into (:func:`split_group_host` per donor group); :meth:`HostMoves.alloc` is
    their allocation.

    Args:
        load, target: static loads and targets per rank (ints ``[R]``).
        total_E: records per expert (ints ``[E]``).
        edges: ints ``[R + 1]``, rank ``r``'s home experts ``[edges[r], edges[r + 1])``.
        warm: ``previous``'s residents, :func:`warm_maps` (``(None, {})``: none).
        previous: last step's flows in order (``[]``: none).
    """
    warm_by_receiver, warm_experts = warm
    flows = host_flows(load, target, warm_by_receiver, previous)
    dests: dict[int, list[tuple[int, int]]] = {}
    for d, r, q in flows:
        dests.setdefault(d, []).append((r, q))
    remaining = list(total_E)
    moves: list[tuple[int, int, int]] = []
    for d, out in dests.items():
        group = range(edges[d], edges[d + 1])
        moves += split_group_host(group, remaining, out, warm_experts.get(d, {}))
    return HostMoves(flows, moves, remaining)
