"""``auto``'s early exit: a bound that every candidate but ``static`` meets, from the counts.

Legend:
    R ranks    E experts    G ranks per fast-link domain    N records in all
    T[e]       records of expert e        tile(x)  x rounded up to ``tile_rows``
    lat        ``base_latency_s + per_peer_latency_s * (R - 1)`` (0 with one rank)

When the exit's plan (static EP, or the ``resident`` candidate where replicas are
resident: ``moonplan.plan.choice.reference``), charged only the exit's planning
(``StepCost.exit_s``), is predicted at most this bound, no candidate can beat it even
before its own planning (``StepCost.plan_s``) is added: ``auto`` returns it and builds
nothing else. The bound is the least time of a plan that:

* **copies weights** (a replica not resident): the step waits at least for one copy
  (``base_latency_s`` plus the cheapest copy over a link class the group has), and for
  the dispatch, a balanced experts phase and the combine:
  ``plan_s + max(lat + experts_lb, base + copy_min) + lat`` (overlapped schedule;
  serially the copy is added to the rest). With the overlapped schedule a copy reads its
  expert's weights beside the sender's home rows (``StepCost``): a home expert with
  records and no resident replica elsewhere costs its home rank one weight read whether
  its rows stay or are copied away, so the experts phase is also at least
  ``weight_read_s`` times the most such experts on one rank;
* **copies nothing**, where no replica is resident: the only such plan is static EP
  itself, and the bound is its time charged ``plan_s``. Where replicas are resident, the
  ``resident`` candidate stands for the plans that copy nothing: it balances inside the
  resident replicas close to the least largest load they allow (within 0-2% at sigma
  0.5-1, 7.9-8.3% at sigma 2: ``moonplan.plan.choice.resident``), so the full call is
  made only where a copy could beat the exit (the full call has no better plan that
  copies nothing either).

``experts_lb`` bounds the slowest rank's experts phase in any plan, from two facts. The
ranks' padded rows add up to at least ``sum_e tile(T[e])`` (padding a split expert never
pads less), and their weight reads and rows to at least ``weight_read_s * Z + row_mem_s *
N``, ``Z`` the experts with records: the slowest rank is at least the mean of each, and
its padded rows, a whole number of tiles, at least that mean rounded up to one. And
every expert with records runs on some rank, so some rank runs at least ``k = ceil(Z / R)``
of them, each at least one tile and one row: ``k * tile_rows`` padded rows and
``k * (weight_read_s + row_mem_s)`` of weight reads and rows. At decode sizes, where
every rank reads about ``E / R`` experts' weights, the second fact is the tight one.

The dispatch and the combine are bounded by the rows some rank must send or receive. A
rank keeps local only the records of experts it runs: its home experts, the replicas
resident in its slots, and new replicas, each a copy that its receiving link carries.
So for each rank ``s`` and each number ``j <= M = ceil(E/R)`` of copies it receives, it
sends at least its records less those of its home experts, of its resident replicas and
of its ``j`` largest others (``sends[s][j]``), and its copies arrive no sooner than
``base_latency_s + max(j, 1) * copy_min``. A plan that copies gives each rank some
``j``: its time is at least, for every rank, the least over ``j`` of that rank's
bound, hence at least the largest of those over the ranks. Split over the link classes in
any way, ``n`` rows
take at least ``n * h`` seconds, ``h`` the rate of the one class (one domain) or
``ri * ro / (ri + ro)`` (two).

**Plans that copy nothing** (:func:`nocopy_s`). Such a plan runs each expert on its home
or a rank holding it resident, so every rank sends at least ``sends[s][0]`` rows (``far[s]``
of them over the slow link), the experts phase is at least ``experts_lb``, and each rank
runs all the rows of its kept experts (home experts with records and no resident replica:
they have nowhere else to go), so its experts phase is at least ``StepCost``'s roofline of
their padded rows, weight reads and rows, its kept section (:func:`kept_section_s`; the
roofline grows with each of the three). An expert with records resident on exactly one
rank ``g`` besides its home ``h`` runs on ``h`` or ``g``, beside the kept experts of both:
the two ranks' padded rows, whole tiles, add up to at least all of theirs, so one runs at
least half of those tiles, rounded up, and one reads at least half their weight reads and
rows (the pair's kept section; a subset of ranks that must run a set of experts, as in
Hall's condition, taken for the pairs a single replica joins). So a plan that copies
nothing takes at least ``plan_s + lat + d + max(experts_lb, kept) + lat + c`` with
``(d, c)`` the most link seconds of any rank's rows and ``kept`` the slowest rank's or
pair's kept section. (The kept term was once the weight reads alone,
``max(kept) * weight_read_s``, then each rank's kept section alone; with replicas resident
at decode sizes the exit then built ``resident`` plans that could not beat static EP:
``docs/benchmarks.md``.)
The exit builds the ``resident`` candidate (at least ``rent.exit_build_s``: its test and one
round a rounding) only where its cheap plans are above that
(``moonplan.plan.choice.reference``).

Some rank receives each copy, and it pays for it three times over: with the overlapped
schedule the copy is read beside its home section, which also holds one read for each of its
``kept[r]`` home experts with records and no resident replica elsewhere (``copies weights``
above); and after the copy arrives, its fetched section runs the copy: at least one tile,
one weight read and one row (``fetched``, :func:`fetched_min_s`). So a plan in which rank
``r`` receives ``j >= 1`` copies and sends at least ``sends[r][j]`` rows takes at least
``plan_s + max(D + max(reads, (kept[r] + j) * weight_read_s + j * fetched), base + j *
copy_min + j * fetched) + Cb`` (serially ``plan_s + D + max(reads, j * fetched) + Cb`` plus
the wait), and some rank receives: the least of that over ranks and ``j`` is a bound too,
and the larger of the two holds. At decode sizes, where every rank already reads each of its
home experts, this is the term that shows a copy cannot pay.

With several domains the links know more. Every copy comes from its expert's home rank, so
an expert homed in another domain reaches a rank's domain only by a copy over the slow link
(``copy_s_inter``). A plan that makes such a copy waits at least ``base_latency_s +
copy_s_inter`` for it, then runs it on a receiver that reads at least ``min(kept) + 1``
experts beside: ``plan_s + max(lat + max(reads, (min(kept) + 1) * weight_read_s + fetched),
base + copy_s_inter + fetched) + lat`` (serially ``plan_s + lat + max(reads, fetched) +
lat`` plus the wait). A plan that makes none sends every record of an expert homed in
another domain, and resident in none of the sender's domain's slots, over the slow link:
``far[s]`` rows for rank ``s``, at least ``far[s] * dispatch_row_s_inter`` (and the same for
the combine) whatever else it does. Both terms are only added when the group has more than
one domain.

Every
term is a non-negative product of a rate and an integer, a ``max``, a mean or a sum; in
real arithmetic each is at most the candidate's own term, and adding them in another order
than the step-cost formula changes a sum by a few units in its last place (``2**-52``
relative), so the bound is scaled by ``1 - 2**-40`` (:data:`MARGIN`) and never exceeds a
candidate's predicted time (``tests/plan/choice/test_choice.py`` checks the exit against
every candidate; ``tests/plan/test_choice_kernel_emulated.py`` the kernel's bound against
this one, bit for bit).

Two forms with equal results: plain Python (the definition, :func:`exit_bound`) and
torch (any device, no host read, :func:`exit_bound_torch`); the link rows in three
(:func:`links_reference`, :func:`links_host` on numpy arrays, :func:`links_torch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
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
    totals: tuple[int, int, int],
    links: tuple[list[list[int]], list[int], list[int]],
    static_full: float | None,
) -> tuple[float, float]:
    """The bound of the module docstring, and its part for plans that copy (``inf`` with
    one rank; the rent-or-buy rule reads the second, a buy's least time).

    Args:
        cost: the model.
        num_ranks: ``R``.
        totals: ``(sum_e tile(T[e]), experts with records, N)``.
        links: ``(sends [R][M + 1], far [R], kept [R])`` (module docstring).
        static_full: static EP's time charged ``plan_s`` when ``previous`` holds no
            resident replica (the only copy-free plan), else ``None``.
    """
    R = num_ranks
    if R <= 1:
        return math.inf, math.inf
    sends, far, kept = links
    lat = cost.base_latency_s + cost.per_peer_latency_s * (R - 1)
    experts_lb = experts_lb_s(cost, R, *totals)
    reads = max(experts_lb, max(kept) * cost.weight_read_s) if cost.overlap else experts_lb
    rows, copy, run = link_time(cost, R), copy_min_s(cost, R), fetched_min_s(cost)

    def copying(j: int, n: int, x: int) -> float:  # rank receiving j copies, sending n rows
        (d, c), wait = rows(n, x), cost.base_latency_s + max(j, 1) * copy
        return _total(cost, lat + d, reads, lat + c, wait)

    def receiving(j: int, n: int, x: int, k: int) -> float:  # j >= 1 copies, k kept reads
        (d, c), wait = rows(n, x), cost.base_latency_s + j * copy
        return _received(cost, (lat + d, lat + c), (reads, (k + j) * cost.weight_read_s),
                         (wait, j * run))  # fmt: skip

    copies = max(
        min(copying(j, n, far[s]) for j, n in enumerate(row)) for s, row in enumerate(sends)
    )
    copies = max(copies, min(
        min(receiving(j, n, far[s], kept[s]) for j, n in enumerate(row) if j >= 1)
        for s, row in enumerate(sends)
    ))  # fmt: skip
    if R > cost.domain_size(R):  # a plan that copies over the slow link waits for it
        wait = cost.base_latency_s + cost.copy_s_inter
        slow = (reads, (min(kept) + 1) * cost.weight_read_s)
        copies = min(copies, _received(cost, (lat, lat), slow, (wait, run)))
    first = copies if static_full is None else min(copies, static_full)
    return first * MARGIN, copies * MARGIN


def nocopy_s(
    cost: StepCost,
    num_ranks: int,
    totals: tuple[int, int, int],
    links: tuple[list[list[int]], list[int], list[int]],
    plan_s: float,
    kept_s: float,
) -> float:
    """Seconds no plan that copies nothing beats, charged ``plan_s`` (module docstring,
    "Plans that copy nothing"), scaled by :data:`MARGIN`; ``kept_s``: the slowest rank's
    kept section (:func:`kept_section_s`). Called where replicas are resident, so
    ``R >= 2`` (no slot holds its rank's own home expert)."""
    R = num_ranks
    sends, far, _ = links
    lat = cost.base_latency_s + cost.per_peer_latency_s * (R - 1)
    rows = link_time(cost, R)
    dc = [rows(row[0], far[s]) for s, row in enumerate(sends)]
    D, Cb = lat + max(d for d, _ in dc), lat + max(c for _, c in dc)
    experts = max(experts_lb_s(cost, R, *totals), kept_s)
    return (plan_s + D + experts + Cb) * MARGIN


def kept_section_s(
    cost: StepCost, counts: list[list[int]], resident: set[tuple[int, int]], home: list[int]
) -> float:
    """The slowest kept section, plain Python (the definition): of a rank, ``StepCost``'s
    roofline of the padded rows, weight reads and rows of its home experts with records
    and no resident replica, which every plan that copies nothing runs there
    (``resident``: the ``(e, r)`` pairs in ``previous``'s slots); or of a pair of ranks
    (:func:`_pair_roofline`): an expert with records resident on exactly one rank ``g``
    besides its home ``h`` runs with the kept experts of both on ``h`` or ``g``."""
    R, E = len(counts), len(counts[0])
    holders: dict[int, list[int]] = {}
    for e, r in resident:
        holders.setdefault(e, []).append(r)
    sums = [[0, 0, 0] for _ in range(R)]  # padded rows, experts, rows
    t = cost.tile_rows
    T = [sum(row[e] for row in counts) for e in range(E)]
    for e in range(E):
        if T[e] > 0 and e not in holders:
            sums[home[e]][0] += -(-T[e] // t) * t
            sums[home[e]][1] += 1
            sums[home[e]][2] += T[e]
    out = max(_kept_roofline(cost, *x) for x in sums)
    for e, rs in holders.items():
        if T[e] > 0 and len(rs) == 1 and rs[0] != home[e]:
            a, b = sums[home[e]], sums[rs[0]]
            both = (a[0] + b[0] + -(-T[e] // t) * t, a[1] + b[1] + 1, a[2] + b[2] + T[e])
            out = max(out, _pair_roofline(cost, *both))
    return out


def _kept_roofline(cost: StepCost, padded: int, experts: int, rows: int) -> float:
    """``StepCost``'s roofline of a rank's ``(padded rows, experts, rows)`` (its order)."""
    flop = padded * cost.row_flop_s
    return max(flop, experts * cost.weight_read_s + rows * cost.row_mem_s)


def _pair_roofline(cost: StepCost, padded: int, experts: int, rows: int) -> float:
    """The least slower section of two ranks that run ``(padded rows, experts, rows)``
    between them: each rank's padded rows are whole tiles, so one runs at least half the
    tiles, rounded up; and their weight reads and rows add up to at least these, so one
    reads at least half (every expert is read where it runs)."""
    t = cost.tile_rows
    flop = -(-padded // (2 * t)) * t * cost.row_flop_s
    return max(flop, (experts * cost.weight_read_s + rows * cost.row_mem_s) * 0.5)


def kept_section_host(
    cost: StepCost, counts_RE: np.ndarray, resident_ER: np.ndarray, home_E: np.ndarray
) -> float:
    """:func:`kept_section_s` on host arrays (int64 ``counts_RE``, bool ``resident_ER``,
    int64 ``home_E``)."""
    R = counts_RE.shape[0]
    T_E = counts_RE.sum(0)
    n_E = resident_ER.sum(1)
    kept_E = (T_E > 0) & (n_E == 0)
    t = cost.tile_rows
    pad_E = -(-T_E // t) * t
    pad_R = np.bincount(home_E, np.where(kept_E, pad_E, 0), minlength=R).astype(np.int64)
    n_R = np.bincount(home_E, kept_E, minlength=R).astype(np.int64)
    rows_R = np.bincount(home_E, np.where(kept_E, T_E, 0), minlength=R).astype(np.int64)
    parts = zip(pad_R.tolist(), n_R.tolist(), rows_R.tolist(), strict=True)
    out = max(_kept_roofline(cost, *x) for x in parts)
    g_E = resident_ER.argmax(1)
    (pair_e,) = np.nonzero((T_E > 0) & (n_E == 1) & (g_E != home_E))
    for e in pair_e.tolist():
        h, g = int(home_E[e]), int(g_E[e])
        both = (int(pad_R[h] + pad_R[g] + pad_E[e]), int(n_R[h] + n_R[g] + 1),
                int(rows_R[h] + rows_R[g] + T_E[e]))  # fmt: skip
        out = max(out, _pair_roofline(cost, *both))
    return out


def kept_section_torch(
    cost: StepCost, counts_RE: torch.Tensor, resident_ER: torch.Tensor, home_E: torch.Tensor
) -> torch.Tensor:
    """float64 0-d: :func:`kept_section_s` in torch ops, no host read."""
    R = counts_RE.shape[0]
    T_E = counts_RE.sum(0)
    n_E = resident_ER.sum(1)
    kept_E = (T_E > 0) & (n_E == 0)
    t = cost.tile_rows
    pad_E = (T_E + (t - 1)) // t * t
    zeros_R = torch.zeros(R, dtype=torch.int64, device=counts_RE.device)
    pad_R = zeros_R.index_add(0, home_E, torch.where(kept_E, pad_E, 0))
    n_R = zeros_R.index_add(0, home_E, kept_E.long())
    rows_R = zeros_R.index_add(0, home_E, torch.where(kept_E, T_E, 0))
    flop = pad_R.to(torch.float64) * cost.row_flop_s
    mem = n_R.to(torch.float64) * cost.weight_read_s + rows_R.to(torch.float64) * cost.row_mem_s
    g_E = resident_ER.long().argmax(1)
    pair_E = (T_E > 0) & (n_E == 1) & (g_E != home_E)
    padded = pad_R[home_E] + pad_R[g_E] + pad_E
    half = (padded + (2 * t - 1)) // (2 * t) * t
    n2 = (n_R[home_E] + n_R[g_E] + 1).to(torch.float64) * cost.weight_read_s
    rows2 = (rows_R[home_E] + rows_R[g_E] + T_E).to(torch.float64) * cost.row_mem_s
    pair = torch.maximum(half.to(torch.float64) * cost.row_flop_s, (n2 + rows2) * 0.5)
    pair = torch.where(pair_E, pair, 0.0)
    return torch.maximum(torch.maximum(flop, mem).amax(), pair.amax())


def _total(cost: StepCost, D: float, reads: float, Cb: float, wait: float) -> float:
    """A copying plan's least time from its least dispatch, experts phase, combine and copy
    wait (the overlapped schedule hides the wait behind the dispatch and the experts)."""
    if cost.overlap:
        return cost.plan_s + max(D + reads, wait) + Cb
    return cost.plan_s + D + reads + Cb + wait


def _received(
    cost: StepCost,
    links: tuple[float, float],
    reads: tuple[float, float],
    fetched: tuple[float, float],
) -> float:
    """The least time of a copying plan from the rank that receives copies: its least
    ``(dispatch, combine)``, the ``(experts phase, its home section)`` (at least every
    rank's ``reads``; the section at least its kept and received reads) and its fetched
    ``(copy wait, section)``. Overlapped, the fetched section runs after both the dispatch
    with the home section and the wait; serially the wait is added, and the home section
    holds no copy."""
    (D, Cb), (every, home), (wait, section) = links, reads, fetched
    if cost.overlap:
        return cost.plan_s + max(D + max(every, home + section), wait + section) + Cb
    return cost.plan_s + D + max(every, section) + Cb + wait


def fetched_min_s(cost: StepCost) -> float:
    """Seconds of the least fetched section a copy with records brings its receiver: one
    tile and one weight read and row (``StepCost``'s roofline of one fetched expert)."""
    return max(cost.tile_rows * cost.row_flop_s, cost.weight_read_s + cost.row_mem_s)


def link_time(cost: StepCost, R: int) -> Callable[[int, int], tuple[float, float]]:
    """``(n, x) -> (dispatch, combine)`` least link seconds of a rank sending ``n`` rows,
    ``x`` of them bound for the slow link (used only with several domains)."""
    h_d, h_c = link_rates(cost, R)
    if R <= cost.domain_size(R):
        return lambda n, x: (n * h_d, n * h_c)
    s_d, s_c = cost.dispatch_row_s_inter, cost.combine_row_s_inter
    return lambda n, x: (max(n * h_d, x * s_d), max(n * h_c, x * s_c))


def experts_lb_s(cost: StepCost, num_ranks: int, tiles: int, busy: int, N: int) -> float:
    """``experts_lb`` of the module docstring: the slowest rank's experts phase in any plan."""
    R, t = num_ranks, cost.tile_rows
    k = -(-busy // R)
    flop_lb = max(-(-tiles // (R * t)) * t, k * t) * cost.row_flop_s
    mem_lb = (busy * cost.weight_read_s + N * cost.row_mem_s) / R
    return max(flop_lb, mem_lb, k * cost.weight_read_s + k * cost.row_mem_s)


def link_rates(cost: StepCost, num_ranks: int) -> tuple[float, float]:
    """Seconds a row takes at least on the links, dispatch and combine, however a rank's
    rows are split over the link classes (module docstring)."""
    if cost.domain_size(num_ranks) >= num_ranks:
        return cost.dispatch_row_s_intra, cost.combine_row_s_intra

    def h(a: float, b: float) -> float:
        return a * b / (a + b) if a + b > 0 else 0.0

    return (
        h(cost.dispatch_row_s_intra, cost.dispatch_row_s_inter),
        h(cost.combine_row_s_intra, cost.combine_row_s_inter),
    )


def exit_bound_torch(
    cost: StepCost,
    num_ranks: int,
    totals: tuple[torch.Tensor, ...],
    links: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    static_full: torch.Tensor,
    resident: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 0-d pair: :func:`exit_bound` with tensor inputs (int64 0-d ``totals``, int64
    ``links``, float64 0-d ``static_full``, bool 0-d ``resident``: ``previous`` holds a
    resident replica)."""
    R = num_ranks
    tiles, busy, N = totals
    sends_RJ, far_R, kept_R = links
    inf = torch.full((), math.inf, dtype=torch.float64, device=tiles.device)
    if R <= 1:
        return inf, inf
    lat = cost.base_latency_s + cost.per_peer_latency_s * (R - 1)
    experts_lb = experts_lb_torch(cost, R, tiles, busy, N)
    n_RJ = sends_RJ.to(torch.float64)
    x_R1 = far_R.to(torch.float64)[:, None]
    j_J = torch.arange(n_RJ.shape[1], device=n_RJ.device).to(torch.float64)
    copy, w = copy_min_s(cost, R), cost.weight_read_s
    wait_J = cost.base_latency_s + j_J.clamp(min=1) * copy
    reads = experts_lb
    if cost.overlap:
        reads = torch.maximum(experts_lb, kept_R.max().to(torch.float64) * w)
    d_RJ, c_RJ = _link_time_torch(cost, R, n_RJ, x_R1)
    copies = _total_torch(cost, lat + d_RJ, reads, lat + c_RJ, wait_J).amin(1).amax()
    k_R1 = kept_R[:, None] + torch.arange(1, n_RJ.shape[1], device=n_RJ.device)
    fetched = (cost.base_latency_s + j_J[1:] * copy, j_J[1:] * fetched_min_s(cost))
    home_RJ = k_R1.to(torch.float64) * w
    links_RJ = (lat + d_RJ[:, 1:], lat + c_RJ[:, 1:])
    copies = torch.maximum(
        copies, _received_torch(cost, links_RJ, (reads, home_RJ), fetched).amin()
    )
    if R > cost.domain_size(R):  # a plan that copies over the slow link waits for it
        one = (kept_R.min() + 1).to(torch.float64) * w
        far_s = (cost.base_latency_s + cost.copy_s_inter, fetched_min_s(cost))
        wait, run = (torch.full((), v, dtype=torch.float64, device=tiles.device) for v in far_s)
        slow = _received_torch(cost, (lat, lat), (reads, one), (wait, run))
        copies = torch.minimum(copies, slow)
    bound = torch.where(resident, copies, torch.minimum(copies, static_full)) * MARGIN
    return bound, copies * MARGIN


def nocopy_torch(
    cost: StepCost,
    num_ranks: int,
    totals: tuple[torch.Tensor, ...],
    links: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    plan_s: float,
    kept_s: torch.Tensor,
) -> torch.Tensor:
    """float64 0-d: :func:`nocopy_s` of tensor inputs (int64 0-d ``totals``, int64
    ``links``, float64 0-d ``kept_s``: :func:`kept_section_torch`), no host read."""
    R = num_ranks
    sends_RJ, far_R, _ = links
    lat = cost.base_latency_s + cost.per_peer_latency_s * (R - 1)
    n_R, x_R = sends_RJ[:, 0].to(torch.float64), far_R.to(torch.float64)
    d_R, c_R = _link_time_torch(cost, R, n_R, x_R)
    D, Cb = lat + d_R.max(), lat + c_R.max()
    experts = torch.maximum(experts_lb_torch(cost, R, *totals), kept_s)
    return (plan_s + D + experts + Cb) * MARGIN


def _received_torch(
    cost: StepCost,
    links: tuple[torch.Tensor | float, torch.Tensor | float],
    reads: tuple[torch.Tensor, torch.Tensor],
    fetched: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """:func:`_received` on float64 tensors (broadcast)."""
    (D, Cb), (every, home), (wait, section) = links, reads, fetched
    if cost.overlap:
        inner = torch.maximum(D + torch.maximum(every, home + section), wait + section)
        return cost.plan_s + inner + Cb
    return cost.plan_s + D + torch.maximum(every, section) + Cb + wait


def _total_torch(
    cost: StepCost, D: torch.Tensor | float, reads: torch.Tensor, Cb: torch.Tensor | float,
    wait: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """:func:`_total` on float64 tensors (broadcast)."""
    if cost.overlap:
        return cost.plan_s + torch.maximum(D + reads, wait) + Cb
    return cost.plan_s + D + reads + Cb + wait


def _link_time_torch(
    cost: StepCost, R: int, n: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`link_time` on float64 tensors (broadcast)."""
    h_d, h_c = link_rates(cost, R)
    if R <= cost.domain_size(R):
        return n * h_d, n * h_c
    s_d, s_c = cost.dispatch_row_s_inter, cost.combine_row_s_inter
    return torch.maximum(n * h_d, x * s_d), torch.maximum(n * h_c, x * s_c)


def experts_lb_torch(
    cost: StepCost, R: int, tiles: torch.Tensor, busy: torch.Tensor, N: torch.Tensor
) -> torch.Tensor:
    """float64 0-d: :func:`experts_lb_s` of int64 0-d sums."""
    k, t = (busy + (R - 1)) // R, cost.tile_rows
    flop_lb = torch.maximum((tiles + (R * t - 1)) // (R * t) * t, k * t)
    flop_lb = flop_lb.to(torch.float64) * cost.row_flop_s
    mem_lb = busy.to(torch.float64) * cost.weight_read_s + N.to(torch.float64) * cost.row_mem_s
    k_f = k.to(torch.float64)
    per_k = k_f * cost.weight_read_s + k_f * cost.row_mem_s
    return torch.maximum(torch.maximum(flop_lb, mem_lb / R), per_k)


def links_reference(
    counts: list[list[int]], resident: set[tuple[int, int]], home: list[int], G: int
) -> tuple[list[list[int]], list[int], list[int]]:
    """``(sends [R][M + 1], far [R], kept [R])`` of the module docstring, plain Python
    (``resident``: the ``(e, r)`` pairs in ``previous``'s slots; ``G``: ranks per domain)."""
    R, E = len(counts), len(counts[0])
    M = -(-E // R)
    sends = []
    for s, row in enumerate(counts):
        held = [e for e in range(E) if (e, s) in resident and home[e] != s]
        left = sum(row) - sum(row[e] for e in range(E) if home[e] == s or e in held)
        others = sorted((row[e] for e in range(E) if home[e] != s and e not in held), reverse=True)
        sends.append([left - sum(others[:j]) for j in range(M + 1)])
    near = [{e for e, r in resident if r // G == d} for d in range(-(-R // G))]
    far = [sum(row[e] for e in range(E) if home[e] // G != s // G and e not in near[s // G])
           for s, row in enumerate(counts)]  # fmt: skip
    moved = {e for e, _ in resident}
    kept = [0] * R
    for e, col in enumerate(zip(*counts, strict=True)):
        kept[home[e]] += sum(col) > 0 and e not in moved
    return sends, far, kept


def totals_host(cost: StepCost, total_E: np.ndarray) -> tuple[int, int, int]:
    """``(sum_e tile(T[e]), experts with records, N)`` of the module docstring from the
    records per expert (int64 ``[E]``, host)."""
    t = cost.tile_rows
    return int((-(-total_E // t) * t).sum()), int((total_E > 0).sum()), int(total_E.sum())


def totals_torch(
    cost: StepCost, total_E: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`totals_host` in torch ops (int64 0-d each), no host read."""
    t = cost.tile_rows
    return ((total_E + (t - 1)) // t * t).sum(), (total_E > 0).sum(), total_E.sum()


def links_host(
    counts_RE: np.ndarray, resident_ER: np.ndarray, home_E: np.ndarray, G: int
) -> tuple[list[list[int]], list[int], list[int]]:
    """:func:`links_reference` on host arrays (int64 ``counts_RE``, bool ``resident_ER``,
    int64 ``home_E``): numpy, Python integers out."""
    R, E = counts_RE.shape
    M = -(-E // R)
    r_R = np.arange(R)
    rest_RE = np.where((home_E[None, :] == r_R[:, None]) | resident_ER.T, 0, counts_RE)
    top_RM = -np.sort(-rest_RE, axis=1)[:, :M]
    cum_RJ = np.concatenate([np.zeros((R, 1), dtype=np.int64), np.cumsum(top_RM, 1)], 1)
    sends_RJ = rest_RE.sum(1)[:, None] - cum_RJ
    dom_R = r_R // G
    near_DE = np.zeros((-(-R // G), E), dtype=bool)
    np.logical_or.at(near_DE, dom_R, resident_ER.T)  # resident in domain d
    far_RE = (dom_R[home_E][None, :] != dom_R[:, None]) & ~near_DE[dom_R]
    far_R = np.where(far_RE, counts_RE, 0).sum(1)
    kept_E = (counts_RE.sum(0) > 0) & ~resident_ER.any(1)
    kept_R = np.bincount(home_E, kept_E, minlength=R).astype(np.int64)
    return sends_RJ.tolist(), far_R.tolist(), kept_R.tolist()


def links_torch(
    counts_RE: torch.Tensor, resident_ER: torch.Tensor, home_E: torch.Tensor, G: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sends [R, M + 1], far [R], kept [R])`` int64: :func:`links_reference` in torch
    ops, no host read (``resident_ER``: bool ``[E, R]``)."""
    R, E = counts_RE.shape
    M = -(-E // R)
    r_R = torch.arange(R, device=counts_RE.device)
    home_RE = home_E[None, :] == r_R[:, None]
    local_RE = home_RE | resident_ER.t()
    rest_RE = torch.where(local_RE, 0, counts_RE)
    left_R = rest_RE.sum(1)
    others_RM = rest_RE.topk(M, dim=1).values
    sends_RJ = left_R[:, None] - torch.cat([others_RM.new_zeros(R, 1), others_RM.cumsum(1)], 1)
    dom_R = r_R // G
    near_DE = torch.zeros(-(-R // G), E, dtype=torch.int64, device=counts_RE.device)
    near_DE = near_DE.index_add(0, dom_R, resident_ER.t().long()) > 0  # resident in domain d
    far_RE = (dom_R[home_E][None, :] != dom_R[:, None]) & ~near_DE[dom_R]
    far_R = torch.where(far_RE, counts_RE, 0).sum(1)
    kept_E = (counts_RE.sum(0) > 0) & ~resident_ER.any(1)
    kept_R = torch.zeros_like(left_R).index_add(0, home_E, kept_E.long())
    return sends_RJ, far_R, kept_R
