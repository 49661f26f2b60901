"""The ``resident`` candidate: balance through the replicas already in ``previous``'s slots.

Legend:
    R ranks    E experts    B slots    M = ceil(E/R)    P = R * B slot entries
    X[r]       static load minus the exact target (> 0 donor, < 0 receiver)
    left[e]    records of expert e still on its home rank
    pair       ``(e, r)``: ``e`` in one of rank ``r``'s first ``M`` previous slots

No weight moves: records of a donor's experts go to ranks that already hold them. In
:data:`ROUNDS` rounds, every live pair (its donor still above target, its receiver still
below, records of its expert left at home) moves at once the least of three even shares:
its donor's excess over the donor's live pairs, its receiver's deficit over the
receiver's live pairs, its expert's records left over the expert's live pairs (each share
rounded down). The shares of a donor, a receiver or an expert never add up to more than
what it has, so no donor drops below its target and no receiver rises above its own, and
the loads only move towards exact balance. Only a rank's first ``M`` slots take records,
so it runs at most ``M`` remote experts (invariant 3).

Every pair moves in parallel: a fixed number of rounds of elementwise work and sums over
``P`` entries, no sequential scan, so the CUDA kernel builds it as fast as a level. On
drifting lognormal traces the rounds reach within 0.03% (summed largest loads) of the
sequential rule that moves the largest donor's excess first (``docs/planner-policy.md``,
"The resident candidate"); rounds beyond 4 moved nothing more there.

Two forms with equal results: plain Python (:func:`resident_reference`) and torch (any
device, no host read, :func:`resident_torch`).
"""

from __future__ import annotations

import torch

ROUNDS = 4
"""Rounds of moves (measured: more rounds moved nothing more on the traces above)."""


def resident_reference(
    counts: list[list[int]], prev_slots: list[list[int]] | None, home: list[int]
) -> list[list[int]]:
    """The ``resident`` allocation ``[E][R]`` (plain Python, the definition)."""
    R, E = len(counts), len(counts[0])
    T = [sum(row[e] for row in counts) for e in range(E)]
    alloc = [[0] * R for _ in range(E)]
    load = [0] * R
    for e in range(E):
        alloc[e][home[e]] = T[e]
        load[home[e]] += T[e]
    N = sum(T)
    X = [load[r] - (N // R + (1 if r < N % R else 0)) for r in range(R)]
    M = -(-E // R)
    pairs = [(e, r) for r in range(R) for j, e in enumerate((prev_slots or [[]] * R)[r])
             if e >= 0 and j < M]  # fmt: skip
    left = list(T)
    for _ in range(ROUNDS):
        live = [(e, r) for e, r in pairs if X[home[e]] > 0 and X[r] < 0 and left[e] > 0]
        n_d, n_r, n_e = [0] * R, [0] * R, [0] * E
        for e, r in live:
            n_d[home[e]], n_r[r], n_e[e] = n_d[home[e]] + 1, n_r[r] + 1, n_e[e] + 1
        moves = [(e, r, min(X[home[e]] // n_d[home[e]], -X[r] // n_r[r], left[e] // n_e[e]))
                 for e, r in live]  # fmt: skip
        for e, r, q in moves:
            d = home[e]
            alloc[e][d], alloc[e][r] = alloc[e][d] - q, alloc[e][r] + q
            X[d], X[r], left[e] = X[d] - q, X[r] + q, left[e] - q
    return alloc


def resident_torch(
    counts_RE: torch.Tensor, prev_RB: torch.Tensor | None, home_E: torch.Tensor
) -> torch.Tensor:
    """int64 ``[E, R]``: :func:`resident_reference` on the counts' device, no host read."""
    R, E = counts_RE.shape
    dev = counts_RE.device
    T_E = counts_RE.sum(0)
    alloc_ER = torch.zeros(E, R, dtype=torch.int64, device=dev)
    alloc_ER[torch.arange(E, device=dev), home_E] = T_E
    if prev_RB is None or prev_RB.shape[1] == 0:
        return alloc_ER
    N = T_E.sum()
    r_R = torch.arange(R, device=dev)
    X_R = torch.zeros(R, dtype=torch.int64, device=dev).index_add_(0, home_E, T_E)
    X_R = X_R - (N // R + (r_R < N % R).to(torch.int64))
    M = -(-E // R)
    B = prev_RB.shape[1]
    valid_P = ((prev_RB >= 0) & (torch.arange(B, device=dev) < M)[None, :]).reshape(-1)
    e_P = prev_RB.reshape(-1).clamp(min=0)
    r_P = r_R.repeat_interleave(B)
    d_P = home_E[e_P]
    left_E, moved_P = T_E.clone(), torch.zeros_like(e_P)
    for _ in range(ROUNDS):
        live_P = valid_P & (X_R[d_P] > 0) & (X_R[r_P] < 0) & (left_E[e_P] > 0)
        q_P = _shares(live_P, (X_R, d_P), (-X_R, r_P), (left_E, e_P))
        X_R.index_add_(0, d_P, -q_P).index_add_(0, r_P, q_P)
        left_E.index_add_(0, e_P, -q_P)
        moved_P += q_P
    alloc_ER.index_put_((e_P, d_P), -moved_P, accumulate=True)
    return alloc_ER.index_put_((e_P, r_P), moved_P, accumulate=True)


def _shares(live_P: torch.Tensor, *limits: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """int64 ``[P]``: the least of each limit's even share over its live pairs (0 where
    not live); a limit is ``(amount per owner, owner of each pair)``."""
    q_P = None
    for amount, owner_P in limits:
        n = torch.zeros_like(amount).index_add_(0, owner_P, live_P.to(torch.int64))
        share_P = amount[owner_P] // n[owner_P].clamp(min=1)
        q_P = share_P if q_P is None else torch.minimum(q_P, share_P)
    assert q_P is not None
    return torch.where(live_P, q_P, 0)
