"""Screening of ``policy="auto"``: a lower bound of a candidate's score, before building it.

Legend:
    R ranks, E experts, M = ceil(E/R), N records in all, F group flows
    counts_RE  int64 [R, E] router counts;   T_E  records per expert;   home_E  home rank
    L_R        static loads;   t_R  the candidate's targets
    flow_F3    (donor, receiver, records) of the construction's step 1, in decision order
    cum_RM     int64 [R, M] running sums of each rank's home experts' T, largest first
    prev_RB    previous slots (residents need no copy);   prev_F3  previous flows

The construction (``moonplan/plan/README.md``) decides its group flows (step 1) from
the loads alone, before touching an expert; the screen runs that same step
(:func:`moonplan.plan.group_flows.host_flows`, ``O(R log R)``) and bounds what
step 2 and the layout can make of the flows, without building the plan. A flow
``(d, r, q)`` moves ``q`` records of donor ``d``'s home experts to ``r``; a pair
``(e, r)`` carries at most ``T_e`` records, so the flow needs at least as many
pairs as ``d``'s largest experts take to sum to ``q`` (``Floors.pairs_F``), of
which those resident in ``r``'s previous slots need no copy. A rank that is no
flow's donor keeps every home record. The floors read a ``StepCost``'s fields; a
cost model without them gets the traffic-free bound alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moonplan.plan.group_flows import host_flows
from moonplan.plan.home import home_edges, targets_list
from moonplan.plan.reference import Flow, previous_flows
from moonplan.stepcost.traffic import host_int64

if TYPE_CHECKING:
    from moonplan.plan.choose import CostModel


@dataclass(frozen=True)
class Step:
    """One step's host view shared by every candidate's floors (built once per choice).

    Everything here depends on the counts and ``previous`` alone; what also depends on
    a cost model's tile or domain size is made on first use and kept (:meth:`tiled`,
    :meth:`domains`), so each further bound of the choice pays only for its flows.
    """

    counts_RE: np.ndarray
    home: list[int]
    home_E: np.ndarray
    T_E: np.ndarray
    load_R: np.ndarray
    held_R: np.ndarray  # int64 [R]: home experts with records
    routed_R: np.ndarray  # int64 [R]: records each rank routes (``counts_RE.sum(1)``)
    desc_RM: np.ndarray  # int64 [R, M]: running sums of home experts' T, largest first
    asc_RM: np.ndarray  # int64 [R, M]: running sums of home experts with records, smallest first
    group_RR: np.ndarray  # int64 [s, d]: rows s routes to d's home experts
    res_RR: np.ndarray  # int64 [r, d]: d's experts resident in r's previous slots
    warm: dict[int, set[int]] | None  # the construction's warm pairs (receiver -> groups)
    previous: list[Flow] | None = None  # previous's flows on the host (None: not given)
    slot_RB: np.ndarray | None = None  # int64 [R, B]: previous's slots on the host, or None
    _memo: dict[tuple[str, int], tuple[Any, ...]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @classmethod
    def of(
        cls,
        counts_RE: torch.Tensor,
        prev_RB: torch.Tensor | None = None,
        prev_F3: torch.Tensor | None = None,
    ) -> Step:
        """The view of ``counts_RE``, ``previous``'s slots ``prev_RB`` and, if given, its
        flows ``prev_F3`` (each copied to the host here once, for every candidate)."""
        c = host_int64(counts_RE)
        R, E = c.shape
        edge_R1 = np.array(home_edges(E, R), dtype=np.int64)
        home_E = np.repeat(np.arange(R, dtype=np.int64), np.diff(edge_R1))
        at_EE = (home_E, np.arange(E) - edge_R1[home_E])  # each expert's place in its group
        T_E = c.sum(0)
        load_R = np.bincount(home_E, weights=T_E, minlength=R).astype(np.int64)
        held_R = np.bincount(home_E, weights=T_E > 0, minlength=R).astype(np.int64)
        desc_RM = np.cumsum(-np.sort(-_grouped_RM(T_E, at_EE, R), axis=1), axis=1)
        never = np.iinfo(np.int64).max // (E + 1)  # an expert without records: never emptied
        asc_RM = np.cumsum(np.sort(_grouped_RM(np.where(T_E > 0, T_E, never), at_EE, R)), 1)
        res_RR = np.zeros((R, R), dtype=np.int64)
        warm, slot_RB = None, None
        if prev_RB is not None:
            slot_RB = host_int64(prev_RB)
            r_N, j_N = (slot_RB >= 0).nonzero()
            key_N = r_N * R + home_E[slot_RB[r_N, j_N]]
            res_RR = np.bincount(key_N, minlength=R * R).reshape(R, R)
            warm = _warm(res_RR)
        group_RR = _group_sums_RR(c, edge_R1)
        previous = None if prev_F3 is None else previous_flows(prev_F3)
        views = (desc_RM, asc_RM, group_RR, res_RR)
        home = home_E.tolist()
        return cls(c, home, home_E, T_E, load_R, held_R, c.sum(1), *views, warm, previous,
                   slot_RB)  # fmt: skip

    def tiled(self, tile: int) -> tuple[int, np.ndarray]:
        """``(padded rows, home padded rows [R])`` of the experts' records padded to GEMM
        tiles of ``tile`` rows (made once per tile size)."""
        key = ("tile", tile)
        if key not in self._memo:
            pad_E = (self.T_E + tile - 1) // tile * tile
            R = len(self.load_R)
            self._memo[key] = (int(pad_E.sum()), np.bincount(self.home_E, pad_E, minlength=R))
        return self._memo[key]

    def totals(self) -> tuple[int, int]:
        """``(N, A)``: records in all and experts with records (made once)."""
        key = ("totals", 0)
        if key not in self._memo:
            self._memo[key] = (int(self.load_R.sum()), int(self.held_R.sum()))
        return self._memo[key]

    def domains(self, G: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(same_RR, far_RR, inter_R, intra_R)`` for fast-link domains of ``G`` ranks:
        float64 ``[s, d]`` masks of another rank in ``s``'s domain and of another domain,
        and per group ``d`` the rows routed to it from other domains and from its own
        (made once per domain size)."""
        key = ("domain", G)
        if key not in self._memo:
            R = len(self.load_R)
            dom_R = np.arange(R) // G
            far_RR = dom_R[:, None] != dom_R[None, :]
            near_RR = ~far_RR & ~np.eye(R, dtype=bool)
            inter_R = np.where(far_RR, self.group_RR, 0).sum(0)
            intra_R = np.where(near_RR, self.group_RR, 0).sum(0)
            same, far = near_RR.astype(np.float64), far_RR.astype(np.float64)
            self._memo[key] = (same, far, inter_R, intra_R)
        return self._memo[key]


def _warm(res_RR: np.ndarray) -> dict[int, set[int]]:
    """Receiver -> donor groups resident in its slots (``group_flows.warm_maps``'s first
    map) from the resident counts ``res_RR``."""
    r_N, d_N = res_RR.nonzero()
    warm: dict[int, set[int]] = {}
    for r, d in zip(r_N.tolist(), d_N.tolist(), strict=True):
        warm.setdefault(r, set()).add(d)
    return warm


@dataclass(frozen=True)
class Floors:
    """What the floors read of one candidate: the step, its targets and flows (host numpy)."""

    step: Step
    t_R: np.ndarray
    flow_F3: np.ndarray  # int64 [F, 3]
    pairs_F: np.ndarray  # int64 [F]: fewest pairs of each flow (resident or copied)
    copies_F: np.ndarray  # int64 [F]: fewest of them not resident on the receiver
    given_R: np.ndarray  # int64 [R]: records each rank's flows out give

    @classmethod
    def of(
        cls,
        counts_RE: torch.Tensor,
        target: list[int] | None = None,
        prev_RB: torch.Tensor | None = None,
        prev_F3: torch.Tensor | None = None,
        *,
        replay: bool = True,
        step: Step | None = None,
    ) -> Floors:
        """The floors' view of ``counts_RE`` for ``target`` (``None``: exact balance);
        ``replay=False``: flows decided without ``previous`` (its residents still count);
        ``step``: :meth:`Step.of` of the same counts and ``prev_RB`` (and ``prev_F3``, if
        it was given one), if already built."""
        st = Step.of(counts_RE, prev_RB, prev_F3) if step is None else step
        load = st.load_R.tolist()
        R = len(load)
        t = targets_list(sum(load), R) if target is None else list(target)
        warm = st.warm if replay else None
        previous = st.previous if st.previous is not None else previous_flows(prev_F3)
        flows = host_flows(load, t, warm, previous if replay else [])
        flow_F3 = np.asarray(flows, dtype=np.int64).reshape(-1, 3)
        d_F, r_F, q_F = flow_F3[:, 0], flow_F3[:, 1], flow_F3[:, 2]
        pairs_F = (st.desc_RM[d_F] < q_F[:, None]).sum(1) + 1
        copies_F = pairs_F - st.res_RR[r_F, d_F]
        np.maximum(copies_F, 0, out=copies_F)
        given_R = np.bincount(d_F, weights=q_F, minlength=R).astype(np.int64)
        return cls(st, np.asarray(t, dtype=np.int64), flow_F3, pairs_F, copies_F, given_R)


def lower_bound(
    cost: CostModel,
    counts_RE: torch.Tensor,
    planned: int,
    *,
    target: list[int] | None = None,
    prev_RB: torch.Tensor | None = None,
    prev_F3: torch.Tensor | None = None,
    horizon: float = 1.0,
    replay: bool = True,
    step: Step | None = None,
) -> float:
    """A lower bound of a balancing candidate's ``choose.score`` with ``planned`` runs.

    ``target``: the candidate's per-rank records (``None``: exact balance);
    ``prev_RB``, ``prev_F3``: the previous plan's slots (its residents need no
    copy) and flows (the construction may replay them); ``replay=False``: the
    construction without ``previous=`` (the ``greedy`` candidate), whose replicas still
    reuse the residents. ``step``: :meth:`Step.of` of these counts, slots and flows,
    shared by the candidates of one choice.

    The step of two imagined ranks, free of traffic (every row computed where it
    was routed, nothing fetched): rank 0 runs ``k = ceil(A/R)`` experts of one
    row each (``A`` experts with records: some rank of any plan runs at least
    ``k``, each padded to a tile and read once), rank 1 runs the largest target
    in rows of one expert. A ``StepCost`` grows with rows, experts and traffic,
    so the candidate's step time without its fetch is at least this one's. Three
    floors a ``StepCost`` allows on top: the busiest rank's experts
    (:func:`experts_floor`), the dispatch and combine rows a rank must send or
    receive (:func:`link_floor`), and the weight copies (:func:`fetch_floor`), of
    which the score charges ``1/horizon`` of the part the step waits for. Only the
    ``k`` imagined experts are passed, so the bound costs little next to scoring a plan.
    """
    view = Floors.of(counts_RE, target, prev_RB, prev_F3, replay=replay, step=step)
    free_s, experts_s, combine_s = _free(cost, view, planned)
    lift = max(0.0, experts_floor(cost, view) - experts_s)
    d_link, c_link = link_floor(cost, view)
    without = free_s + lift + d_link + c_link
    fetch = fetch_floor(cost, view)
    if fetch <= 0:
        return without
    if getattr(cost, "overlap", False):  # the receiver waits for the copy, then runs its rows
        rates = [float(getattr(cost, n, 0.0)) for n in ("weight_read_s", "row_mem_s", "row_flop_s")]
        one = max(rates[0] + rates[1], rates[2] * int(getattr(cost, "tile_rows", 1)))
        comb = combine_s + c_link
        total = max(without, planned * cost.plan_s + fetch + one + comb)
    else:  # serial: the fetch adds to the step
        total = without + fetch
    return without + (total - without) / horizon


def _free(cost: CostModel, view: Floors, planned: int) -> tuple[float, float, float]:
    """``(total, experts, combine)`` seconds of the imagined traffic-free step (see
    :func:`lower_bound`): in closed form for a ``StepCost``'s fields, else predicted by
    ``cost.step_time`` on the imagined ranks."""
    R = len(view.step.load_R)
    k = -(-view.step.totals()[1] // R)
    top = int(view.t_R.max())
    rates = _rates(cost, _STEP_FIELDS)
    if rates is not None:
        flop, read, mem, tile, base, per_peer = rates
        one = base + per_peer * (R - 1)
        lat = one if R > 1 else 0.0
        rank0 = max(flop * tile * k, (read + mem) * k)
        rank1 = max(flop * (-(-top // int(tile)) * tile), read + mem * top) if top > 0 else 0.0
        experts = max(rank0, rank1)
        return planned * cost.plan_s + 2 * lat + experts, experts, lat
    rows_KR = torch.zeros(max(k, 1), R, dtype=torch.int64)  # imagined experts
    rows_KR[:k, 0] = 1
    if R > 1:
        rows_KR[0, 1] = top
    sent_RK = rows_KR.t().contiguous()  # every row stays on the rank that routed it
    fetch_KR = torch.zeros(rows_KR.shape, dtype=torch.bool)
    src_K = torch.zeros(rows_KR.shape[0], dtype=torch.int64)
    free = cost.step_time(rows_KR, sent_RK, fetch_KR, src_K, planned=planned)
    experts = float(getattr(free, "experts_s", math.inf))
    return float(free.total_s), experts, float(getattr(free, "combine_s", 0.0))


_STEP_FIELDS = (
    "row_flop_s",
    "weight_read_s",
    "row_mem_s",
    "tile_rows",
    "base_latency_s",
    "per_peer_latency_s",
)


def fetch_floor(cost: CostModel, view: Floors) -> float:
    """Seconds until the weight copies of the candidate of ``view`` have all arrived, at least.

    Each flow ``(d, r, q)`` makes at least ``copies_F`` copies from ``d`` to ``r``, over
    the fast link in one domain (``copy_s_intra``) or across (``copy_s_inter``); per
    rank, sends and receives are full duplex and the two link classes run in parallel,
    so the busiest direction of each class counts (as in ``StepCost``), plus
    ``base_latency_s``. 0 for a cost model without those fields or without copies.
    """
    names = ("copy_s_intra", "copy_s_inter", "base_latency_s", "domain_size")
    R = len(view.step.load_R)
    rates = _rates(cost, names[:3])
    if R <= 1 or rates is None or not hasattr(cost, names[3]) or not view.copies_F.any():
        return 0.0
    d_F, r_F = view.flow_F3[:, 0], view.flow_F3[:, 1]
    G = _domain_size(cost, R)
    key_F = 2 * d_F + (d_F // G != r_F // G)  # [rank, class]: 0 inside the domain, 1 across
    send_R2 = np.bincount(key_F, weights=view.copies_F, minlength=2 * R).reshape(R, 2)
    key_F += 2 * (r_F - d_F)
    recv_R2 = np.bincount(key_F, weights=view.copies_F, minlength=2 * R).reshape(R, 2)
    most_2 = np.maximum(send_R2, recv_R2).max(0)
    busiest = max(0.0, float(most_2[0]) * rates[0])
    busiest = max(busiest, float(most_2[1]) * rates[1])
    return rates[2] + busiest if busiest > 0 else 0.0


def experts_floor(cost: CostModel, view: Floors) -> float:
    """Expert seconds the busiest rank of the candidate of ``view`` pays at least.

    Two floors, the larger holds. The ranks' mean: over all ranks, tile-padded
    rows are at least ``sum_e tile(T_e)`` (an expert split over ranks pads once
    per part), weights are read at least once per expert with records (``A``)
    and every record is a row. Per rank ``r``, executing ``t_r`` rows: of its
    ``n_r`` home experts with records, giving ``g_r`` records (its flows out) empties
    at most as many as its smallest ones sum to ``g_r`` or less, so it still runs at
    least ``kept_r`` of them, each at least one tile (all of them, with their
    padded rows, when ``g_r = 0``); every flow into it adds at least its ``pairs_F``
    experts, padded. Read from a ``StepCost``'s rate fields; a cost model without
    them gets 0.
    """
    names = ("row_flop_s", "weight_read_s", "row_mem_s", "tile_rows")
    rates = _rates(cost, names)
    if rates is None:
        return 0.0
    R = len(view.step.load_R)
    st, t_R = view.step, view.t_R
    N, A = st.totals()
    flop_s, read_s, mem_s, tile_s = rates
    tile = int(tile_s)
    pad, home_pad0_R = st.tiled(tile)
    mean = max(flop_s * pad / R, (read_s * A + mem_s * N) / R)
    r_F = view.flow_F3[:, 1]
    q_F, given_R = view.flow_F3[:, 2], view.given_R
    kept_R = st.held_R - (st.asc_RM <= given_R[:, None]).sum(1)
    left_R = st.load_R - given_R
    home_pad_R = np.maximum((left_R + tile - 1) // tile * tile, kept_R * tile)
    home_pad_R = np.where(given_R == 0, home_pad0_R, home_pad_R)
    pad_F = np.maximum((q_F + tile - 1) // tile * tile, view.pairs_F * tile)
    # per receiving rank, as floats (exact integers)
    flop_R = flop_s * (home_pad_R + np.bincount(r_F, weights=pad_F, minlength=R))
    mem_R = read_s * (kept_R + np.bincount(r_F, view.pairs_F, minlength=R)) + mem_s * t_R
    return max(mean, float(np.maximum(flop_R, mem_R).max()))


def _group_sums_RR(c_RE: np.ndarray, edge_R1: np.ndarray) -> np.ndarray:
    """int64 ``[R, R]``: row sums of ``c_RE`` over each rank's (contiguous) home experts,
    rank ``r``'s being ``[edge_R1[r], edge_R1[r + 1])``."""
    cum_RE1 = np.zeros((c_RE.shape[0], c_RE.shape[1] + 1), dtype=np.int64)
    np.cumsum(c_RE, axis=1, out=cum_RE1[:, 1:])
    return cum_RE1[:, edge_R1[1:]] - cum_RE1[:, edge_R1[:-1]]


def _grouped_RM(v_E: np.ndarray, at_EE: tuple[np.ndarray, np.ndarray], R: int) -> np.ndarray:
    """int64 ``[R, M]``: ``v_E`` of each rank's home experts, 0-padded to ``M`` columns
    (``at_EE``: each expert's home rank and place among its home experts)."""
    E = len(v_E)
    out_RM = np.zeros((R, -(-E // R)), dtype=np.int64)
    out_RM[at_EE] = v_E
    return out_RM


def link_floor(cost: CostModel, view: Floors) -> tuple[float, float]:
    """Dispatch and combine link seconds the candidate of ``view`` pays at least.

    Rank ``r`` computes at most ``keep_r`` of the rows it routes itself: its rows to
    its home experts, plus, for each flow ``(d, r, q)`` into it, at most
    ``min(q, its rows to d's home experts)``. It sends at least ``S_r - keep_r``
    rows (``S_r``: rows it routes) and receives at least ``t_r - keep_r``. A link
    time is at least ``n * a`` in one fast-link domain (``a``: the intra rate) and
    ``n * a * b / (a + b)`` across domains (the best split of ``n`` over both link
    classes, ``b`` the inter rate), or more where the senders' link classes are
    known (:func:`_send_split`). Combine sends the same rows back. Read from a
    ``StepCost``'s rate fields; a cost model without them gets ``(0, 0)``.
    """
    R = len(view.step.load_R)
    names = (
        "dispatch_row_s_intra",
        "dispatch_row_s_inter",
        "combine_row_s_intra",
        "combine_row_s_inter",
    )
    rates4 = _rates(cost, names)
    if R <= 1 or rates4 is None or not hasattr(cost, "domain_size"):
        return 0.0, 0.0
    st, t_R = view.step, view.t_R
    group_RR = st.group_RR  # [s, d]: rows s routes to d's home experts
    d_F, r_F, q_F = view.flow_F3[:, 0], view.flow_F3[:, 1], view.flow_F3[:, 2]
    keep_RD = np.zeros((R, R), dtype=np.int64)  # [s, d]: rows s may keep of d's experts
    np.fill_diagonal(keep_RD, group_RR.diagonal())
    keep_RD[r_F, d_F] += np.minimum(q_F, group_RR[r_F, d_F])
    keep_R = keep_RD.sum(1)
    n = max(0.0, float((np.maximum(st.routed_R, t_R) - keep_R).max()))
    G = int(_domain_size(cost, R))
    rates = [rates4[:2], rates4[2:]]
    if G >= R:
        return n * rates[0][0], n * rates[1][0]
    sends = _send_split(view, group_RR - keep_RD, G)
    recvs = _recv_split(view, keep_R, G)
    out = []
    for a, b in rates:
        rate = a * b / (a + b) if a > 0 and b > 0 else 0.0
        out.append(max(n * rate, _split_s(*sends, a, b), _split_s(*recvs, a, b)))
    return out[0], out[1]


Split = tuple[np.ndarray, np.ndarray, np.ndarray]
"""``(n_R, inter_R, intra_R)``: each rank's rows on one direction of its links, and how
many of them surely cross the network and surely stay inside its domain."""


def _recv_split(view: Floors, keep_R: np.ndarray, G: int) -> Split:
    """The busiest receiver's rows when their link classes are partly known.

    Rank ``d`` executes all but the ``g_d`` records it gives of its home experts; of the
    rows routed to them from outside its domain at most ``g_d`` run elsewhere, so at least
    the rest cross the network into ``d`` (likewise from inside its domain). It receives
    at least ``t_d - keep_d`` rows in all; the best split within those limits
    (:func:`_split_s`) is a floor.
    """
    _, _, from_far_R, from_near_R = view.step.domains(G)
    inter_R = from_far_R - view.given_R
    np.maximum(inter_R, 0, out=inter_R)
    intra_R = from_near_R - view.given_R
    np.maximum(intra_R, 0, out=intra_R)
    n_R = np.maximum((view.t_R - keep_R).astype(np.float64), inter_R + intra_R)
    return n_R, inter_R, intra_R


def _split_s(
    n_R: np.ndarray, inter_R: np.ndarray, intra_R: np.ndarray, a: float, b: float
) -> float:
    """``max_r min_y max((n_r - y) a, y b)`` over ``inter_r <= y <= n_r - intra_r``."""
    best = n_R * a / (a + b) if a + b > 0 else n_R
    y_R = np.minimum(np.maximum(best, inter_R), n_R - intra_R)
    return float(np.maximum((n_R - y_R) * a, y_R * b).max())


def _send_split(view: Floors, sent_RD: np.ndarray, G: int) -> Split:
    """The busiest sender's rows when their link classes are partly known.

    The ranks holding some expert of group ``d`` are among ``d`` and the receivers of
    ``d``'s flows; rows ``s`` sends for group ``d`` (``sent_RD``, at least) all cross
    the network when every such rank but ``s`` is outside ``s``'s domain, and all stay
    inside when every one is inside. The rest may take either class; the best split of
    a sender's rows within those limits, ``min_y max((n - y) a, y b)``, is a floor.
    """
    R = len(view.step.load_R)
    hold_DR = np.eye(R, dtype=np.float64)
    hold_DR[view.flow_F3[:, 0], view.flow_F3[:, 1]] = 1.0
    same_RR, far_RR, _, _ = view.step.domains(G)
    near_RD = same_RR @ hold_DR.T  # [s, d]: holders in s's domain
    far_RD = far_RR @ hold_DR.T
    sent_RD = sent_RD.clip(min=0).astype(np.float64)
    inter_R = np.where((far_RD > 0) & (near_RD == 0), sent_RD, 0.0).sum(1)
    intra_R = np.where((near_RD > 0) & (far_RD == 0), sent_RD, 0.0).sum(1)
    return sent_RD.sum(1), inter_R, intra_R


def _rates(cost: CostModel, names: tuple[str, ...]) -> tuple[float, ...] | None:
    """The ``StepCost`` fields ``names`` the floors read, as floats, or ``None`` where the
    cost model lacks any of them (one read each)."""
    values = [getattr(cost, n, None) for n in names]
    return None if None in values else tuple(float(v) for v in values)  # type: ignore[arg-type]


def _domain_size(cost: CostModel, num_ranks: int) -> int:
    return int(getattr(cost, "domain_size")(num_ranks))  # noqa: B009 (not in CostModel)
