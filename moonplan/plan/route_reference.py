"""The readable spec of :func:`moonplan.route`: plain Python loops, no vectorisation.

Legend:
    R ranks, E experts, S tokens on this rank, K top-k, N = S*K records (token-major)
    U unique (token, destination) rows of this rank

Tests compare :func:`moonplan.route` with it bit for bit (``tests/plan/test_route_rows.py``).
The order is ``docs/design.md`` §3, the affinity rule ``route_affinity``, the
token-buffer layout ``route_rows``.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.plan.plan_type import Plan


def route_reference(plan: Plan, rank: int, topk_ids: Any, *, affinity: bool = False) -> dict:
    """Route ``rank``'s records like :func:`moonplan.route`, as plain lists.

    Args:
        plan: the step's plan.
        rank: the source rank.
        topk_ids: ``[S, K]`` expert ids (a tensor or nested lists), counts matching the plan.
        affinity: as in :func:`moonplan.route`.

    Returns:
        dict of lists: ``dest_rank``, ``dest_offset``, ``record_unique`` (``N`` each,
        token-major), ``send_counts`` and ``unique_counts`` (``R``), ``unique_token``,
        ``unique_dest``, ``unique_offset`` (``U``).
    """
    ids = [
        [int(v) for v in row]
        for row in (topk_ids.tolist() if isinstance(topk_ids, torch.Tensor) else topk_ids)
    ]
    R, E = plan.num_ranks, plan.num_experts
    K = len(ids[0]) if ids else 0
    counts = plan.counts.tolist()
    alloc = plan.alloc.tolist()
    flat = [e for row in ids for e in row]
    # cap[e][d]: records of this rank's segment of expert e that destination d executes;
    # seg[e][d]: the offset in d's receive buffer where this rank's first such record goes.
    cap = [[0] * R for _ in range(E)]
    seg = [[0] * R for _ in range(E)]
    for e in range(E):
        for d, skip, n in _overlaps(counts, alloc, rank, e):
            cap[e][d] = n
            seg[e][d] = _row_start(plan, d, e) + skip
    mine = [[i for i, x in enumerate(flat) if x == e] for e in range(E)]  # local order
    dest = [-1] * len(flat)
    split = [sum(1 for d in range(R) if cap[e][d]) > 1 for e in range(E)]
    for e in range(E):  # plain order; for affinity, only the experts not split
        if affinity and split[e]:
            continue
        _fill(mine[e], cap[e], dest)
    if affinity and any(split):
        plain = list(dest)
        for e in range(E):
            if split[e]:
                _fill(mine[e], cap[e], plain)
        have = {(i // K, dest[i]) for i in range(len(flat)) if dest[i] >= 0}
        left = [list(c) for c in cap]
        for d in range(R):
            for e in range(E):
                if not split[e]:
                    continue
                for i in mine[e]:
                    if dest[i] < 0 and left[e][d] > 0 and (i // K, d) in have:
                        dest[i] = d
                        left[e][d] -= 1
        for e in range(E):
            if split[e]:
                _fill([i for i in mine[e] if dest[i] < 0], left[e], dest)
        if _rows(dest, K) > _rows(plain, K):  # the greedy lost: plain order
            dest = plain
    offset = [0] * len(flat)
    for e in range(E):
        for d in range(R):
            for j, i in enumerate([i for i in mine[e] if dest[i] == d]):
                offset[i] = seg[e][d] + j
    send_counts = [sum(1 for x in dest if x == d) for d in range(R)]
    return {
        "dest_rank": dest,
        "dest_offset": offset,
        "send_counts": send_counts,
        **_unique(plan, rank, dest, K, len(ids)),
    }


def _rows(dest: list[int], K: int) -> int:
    """Distinct (token, destination) pairs of records ``dest`` (token-major)."""
    return len({(i // K, d) for i, d in enumerate(dest)})


def _fill(records: list[int], share: list[int], dest: list[int]) -> None:
    """Give ``records`` (local order) to destinations in ascending rank, ``share[d]`` each."""
    it = iter(records)
    for d, n in enumerate(share):
        for _ in range(n):
            dest[next(it)] = d


def _overlaps(
    counts: list[list[int]], alloc: list[list[int]], s: int, e: int
) -> list[tuple[int, int, int]]:
    """``(d, skip, n)`` for every destination ``d`` that executes records of source ``s``'s
    segment of expert ``e`` (the routing rule): ``n`` of them, after ``skip`` records of
    ``d``'s own segment."""
    lo = sum(counts[q][e] for q in range(s))
    hi = lo + counts[s][e]
    out, a = [], 0
    for d, n_d in enumerate(alloc[e]):
        first, last = max(lo, a), min(hi, a + n_d)
        if last > first:
            out.append((d, first - a, last - first))
        a += n_d
    return out


def _row_start(plan: Plan, d: int, e: int) -> int:
    """Offset of rank ``d``'s row executing expert ``e`` in its receive buffer."""
    for w in range(plan.num_rows):
        if int(plan.row_expert[d, w]) == e and int(plan.row_count[d, w]) > 0:
            return int(plan.row_offset[d, w])
    raise AssertionError(f"rank {d} has no row for expert {e}")


def _unique(plan: Plan, rank: int, dest: list[int], K: int, S: int) -> dict:
    """Unique (token, destination) rows, sorted by (destination, token), and the token
    buffer rows: source ``s``'s block of ``d`` starts after every lower source's records."""
    R, E = plan.num_ranks, plan.num_experts
    counts, alloc = plan.counts.tolist(), plan.alloc.tolist()
    start = [0] * R
    for s in range(rank):
        for e in range(E):
            for d, _, n in _overlaps(counts, alloc, s, e):
                start[d] += n
    rows: list[tuple[int, int]] = sorted({(dest[i], i // K) for i in range(len(dest))})
    index = {row: u for u, row in enumerate(rows)}
    offset, per_dest = [], [0] * R
    for d, _t in rows:
        offset.append(start[d] + per_dest[d])
        per_dest[d] += 1
    return {
        "unique_token": [t for _d, t in rows],
        "unique_dest": [d for d, _t in rows],
        "unique_offset": offset,
        "record_unique": [index[(dest[i], i // K)] for i in range(len(dest))],
        "unique_counts": per_dest,
    }
