"""The reference planner: the readable definition of a correct moonplan plan.

Plain Python integers, no vectorisation; every other backend must give the same
plan bit for bit. See ``moonplan/plan/README.md`` for the derivation.

Legend:
    R ranks, E experts, B slots, M = ceil(E/R), W = M + max(B, M) rows per rank
    T[e]  records routed to expert e (column sums of counts)
    L[r]  static load of rank r (records of its home experts)
    X[r]  L[r] - target[r]: > 0 donor (excess), < 0 receiver (deficit)

Steps:
    1. balance whole home groups: the donor with the largest excess fills the
       receiver with the largest deficit *completely*; a donor that overshoots
       becomes a receiver. Every receiver is filled by exactly one donor group,
       so it executes remote experts of one group only: at most M of them.
       With ``previous=``, last step's flows are first replayed where they
       still fit, then resident (warm) pairs go first.
    2. split each donor group's outflows over its experts: the destination with
       the largest remaining quota takes from the group's expert with the most
       remaining records (with ``previous=``: from an expert already resident
       in one of the destination's slots first). The home keeps the rest.
    3. place replicas in slots (largest first; residents stay in their slot),
       the rest are direct; lay out rows and padded offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moonplan.plan.home import home_list, home_start, max_local, targets_list
from moonplan.plan.plan_fields import PlanFields, padded_flows

Flow = tuple[int, int, int]  # (donor rank, receiver rank, records)
Move = tuple[int, int, int]  # (expert, rank, records)


@dataclass
class RefResult:
    """Plain-list output of :func:`reference_plan` (``Plan`` is built from it)."""

    alloc: list[list[int]]  # [E][R]
    target: list[int]  # [R]
    home: list[int]  # [E]
    flows: list[Flow]  # at most R - 1, in decision order
    slot_expert: list[list[int]]  # [R][B]
    slot_new: list[list[int]]  # [R][B]
    row_expert: list[list[int]]  # [R][W]
    row_count: list[list[int]]  # [R][W]
    row_offset: list[list[int]]  # [R][W+1]


def keep_previous_flows(
    load: list[int], X: list[int], previous: list[Flow], filled: set[int]
) -> list[Flow]:
    """Step 1a (``previous=``): replay last step's group flows where they still fit.

    In last step's order, donor ``d`` fills receiver ``r`` again (its whole
    current deficit) if ``r`` is still short, neither rank has been filled yet
    (a filled rank never gives, so each rank keeps one donor group), and ``d``'s
    home group still has the records. Updates ``X`` and ``filled`` in place.
    """
    given = [0] * len(load)
    flows: list[Flow] = []
    for d, r, _ in previous:
        if X[r] < 0 and r not in filled and d not in filled and load[d] - given[d] >= -X[r]:
            flows.append((d, r, -X[r]))
            given[d] -= X[r]
            X[d] += X[r]
            X[r] = 0
            filled.add(r)
    return flows


def balance_groups(
    load: list[int], target: list[int], warm: set[tuple[int, int]], previous: list[Flow]
) -> list[Flow]:
    """Step 1: group-level flows, in the order they are decided.

    After step 1a (:func:`keep_previous_flows`, with ``previous=``), the donor
    with the largest excess fills the receiver with the largest deficit
    completely; it may overshoot and then becomes a receiver. With ``previous=``,
    ``warm`` holds ``(donor, receiver)`` pairs where the receiver has a slot
    resident with an expert of the donor's group, and warm pairs go first (the
    largest deficit, then the largest excess). Ties: the lowest rank id wins.
    Every rank is filled by at most one flow, so there are at most ``R - 1``.
    """
    X = [load[r] - target[r] for r in range(len(load))]
    flows = keep_previous_flows(load, X, previous, set())
    while True:
        donors = [r for r in range(len(X)) if X[r] > 0]
        if not donors:
            return flows
        receivers = [r for r in range(len(X)) if X[r] < 0]
        pairs = [(d, r) for d in donors for r in receivers if (d, r) in warm]
        if pairs:
            d, r = min(pairs, key=lambda dr: (X[dr[1]], -X[dr[0]], dr[1], dr[0]))
        else:
            d = max(donors, key=lambda r: (X[r], -r))
            r = min(receivers, key=lambda r: (X[r], r))
        quota = -X[r]
        flows.append((d, r, quota))
        X[r] = 0
        X[d] -= quota  # may go negative: the donor overshot and is now a receiver


def split_group(
    experts: list[int],
    remaining: list[int],
    dests: list[tuple[int, int]],
    resident: set[tuple[int, int]],
) -> list[Move]:
    """Step 2 for one donor group: move each destination's quota out of ``remaining``.

    Args:
        experts: the group's expert ids (ascending).
        remaining: records per expert still unassigned (updated in place, indexed by id).
        dests: ``(rank, quota)`` outflows of this group.
        resident: ``(expert, rank)`` pairs already resident in a slot (``previous=``).

    Returns:
        ``(expert, rank, records)`` moves, in the order they are decided.
    """
    moves: list[Move] = []
    quota = dict(dests)
    while quota:
        r = max(quota, key=lambda k: (quota[k], -k))
        live = [e for e in experts if remaining[e] > 0]
        warm = [e for e in live if (e, r) in resident]
        e = max(warm or live, key=lambda k: (remaining[k], -k))
        take = min(quota[r], remaining[e])
        moves.append((e, r, take))
        remaining[e] -= take
        quota[r] -= take
        if quota[r] == 0:
            del quota[r]
    return moves


def place_slots(
    replicas: list[tuple[int, int]], prev_slots: list[int] | None, B: int
) -> tuple[list[int], list[int], list[int]]:
    """Step 3 for one rank: which replica sits in which slot.

    Args:
        replicas: ``(expert, records)`` of this rank's remote experts.
        prev_slots: the previous plan's slots of this rank (``None``: no residents).
        B: slots per rank.

    Returns:
        ``(slot_expert [B], slot_new [B], direct)``: residents keep their slot; new
        replicas take empty slots first, then slots whose resident is not used,
        in slot order, largest replica first; the rest are direct (largest first).
    """
    order = sorted(replicas, key=lambda er: (-er[1], er[0]))
    slots = list(prev_slots) if prev_slots is not None else [-1] * B
    new = [0] * B
    used = {e for e, _ in order}
    kept = {e for e in slots if e in used}
    free = [j for j in range(B) if slots[j] == -1] + [
        j for j in range(B) if slots[j] != -1 and slots[j] not in used
    ]
    direct: list[int] = []
    for e, _ in order:
        if e in kept:
            continue
        if free:
            j = free.pop(0)
            slots[j], new[j] = e, 1
        else:
            direct.append(e)
    return slots, new, direct


def row_layout(
    rank: int,
    alloc: list[list[int]],
    E: int,
    R: int,
    B: int,
    slots: list[int],
    direct: list[int],
    align: int,
) -> tuple[list[int], list[int], list[int]]:
    """Rows of one rank: home experts, slots, direct replicas; counts and padded offsets."""
    M = max_local(E, R)
    W = M + max(B, M)
    first, last = home_start(rank, E, R), home_start(rank + 1, E, R)
    home_rows = list(range(first, last))
    rows = home_rows + [-1] * (M - len(home_rows)) + slots + direct
    rows += [-1] * (W - len(rows))
    counts = [alloc[e][rank] if e >= 0 else 0 for e in rows]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // align) * align)
    return rows, counts, offsets


def reference_plan(
    counts_RE: list[list[int]],
    B: int,
    align: int,
    prev_slots: list[list[int]] | None = None,
    prev_flows: list[Flow] | None = None,
    target: list[int] | None = None,
) -> RefResult:
    """The whole plan from plain lists (see the module docstring for the steps).

    ``prev_slots`` ``[R][B]`` and ``prev_flows`` (``(donor, receiver, records)``
    in decision order) describe the ``previous=`` plan, or are ``None``.
    ``target`` ``[R]`` replaces the exact targets (bounded-imbalance candidates,
    ``moonplan/plan/candidates.py``): it must sum to ``N``, every donor's target
    (``load > target``) must be at least every other target, and ranks that
    are neither donors nor receivers keep their static load.
    """
    R, E = len(counts_RE), len(counts_RE[0])
    home = home_list(E, R)
    T = [sum(row[e] for row in counts_RE) for e in range(E)]
    target = list(target) if target is not None else targets_list(sum(T), R)
    load = [0] * R
    for e, t in enumerate(T):
        load[home[e]] += t

    alloc = [[0] * R for _ in range(E)]
    resident = set()
    if prev_slots is not None:
        resident = {(e, r) for r in range(R) for e in prev_slots[r] if e >= 0}
    remaining = list(T)
    warm = {(home[e], r) for e, r in resident}
    flows = balance_groups(load, target, warm, prev_flows or [])
    for d in range(R):
        dests = [(r, q) for (dd, r, q) in flows if dd == d]
        experts = [e for e in range(E) if home[e] == d]
        for e, r, take in split_group(experts, remaining, dests, resident):
            alloc[e][r] += take
    for e in range(E):
        alloc[e][home[e]] += remaining[e]

    out = RefResult(alloc, target, home, flows, [], [], [], [], [])
    for r in range(R):
        replicas = [(e, alloc[e][r]) for e in range(E) if alloc[e][r] > 0 and home[e] != r]
        slots, new, direct = place_slots(replicas, prev_slots[r] if prev_slots else None, B)
        rows, rcounts, offsets = row_layout(r, alloc, E, R, B, slots, direct, align)
        out.slot_expert.append(slots)
        out.slot_new.append(new)
        out.row_expert.append(rows)
        out.row_count.append(rcounts)
        out.row_offset.append(offsets)
    return out


def to_tensors(res: RefResult, device: torch.device) -> PlanFields:
    """The :class:`RefResult` lists as int64 tensors on ``device``."""
    R = len(res.target)

    def t(x: list, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=device).reshape(shape)

    B = len(res.slot_expert[0]) if res.slot_expert else 0
    W = len(res.row_expert[0])
    return PlanFields(
        alloc=t(res.alloc, (len(res.home), R)),
        target=t(res.target, (R,)),
        home=t(res.home, (len(res.home),)),
        flow=padded_flows(res.flows, R, device),
        slot_expert=t(res.slot_expert, (R, B)),
        slot_new=t(res.slot_new, (R, B)),
        row_expert=t(res.row_expert, (R, W)),
        row_count=t(res.row_count, (R, W)),
        row_offset=t(res.row_offset, (R, W + 1)),
    )


def previous_flows(prev_F3: torch.Tensor | None) -> list[Flow]:
    """A previous plan's flows ``[R-1, 3]`` (any device) as host tuples in decision order,
    the padding flows ``(-1, -1, 0)`` dropped (``[]`` for ``None``)."""
    if prev_F3 is None:
        return []
    return [(d, r, q) for d, r, q in prev_F3.tolist() if d >= 0]


def reference_fields(
    counts_RE: torch.Tensor,
    B: int,
    align: int,
    prev: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    *,
    target: list[int] | None = None,
    device: torch.device | None = None,
) -> PlanFields:
    """:func:`reference_plan` on tensors: the plan's layout tensors (int64) of ``counts_RE``.

    ``prev`` is the previous plan's ``(slot_expert [R, B], flow [R-1, 3])`` on any device
    (either may be ``None``; the padding flows ``(-1, -1, 0)`` are dropped), or ``None``;
    ``target`` as :func:`reference_plan`'s. The fields are on ``device`` (default: the
    CPU). The reference backend, the reference builder of ``policy=`` and the twin that
    the GPU checks compare ``plan_cuda`` against.
    """
    prev_RB, prev_F3 = (None, None) if prev is None else prev
    slots = None if prev_RB is None else prev_RB.tolist()
    flows = None if prev_F3 is None else previous_flows(prev_F3)
    res = reference_plan(counts_RE.tolist(), B, align, slots, flows, target)
    return to_tensors(res, torch.device("cpu") if device is None else device)
