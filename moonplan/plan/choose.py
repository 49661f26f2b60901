"""``policy=`` of :func:`moonplan.plan`: build one named candidate, or choose among them (``auto``).

Legend:
    R ranks, E experts, B slots, N records in all
    counts_RE   int64 [R, E] validated router counts
    prev_RB     int64 [R, B] previous plan's slots (or None), prev_F3 its flows

Candidates, in the order they are evaluated (ties go to the earlier one):

``static`` and ``resident`` (only with ``previous=``, and only when it moves
records) first: they need no planner run. Then the balancing candidates
(:func:`balancing_order`): the previous plan's candidate (``previous.policy``)
first, as it usually wins again, then ``exact``, then ``bounded-<eps>`` for
``eps`` in :data:`EPS` (largest first). A balancing candidate whose targets
equal the static loads or another candidate's targets is skipped: it would be
the same plan, planned again.

``auto`` scores each candidate with :func:`score` of
``cost.plan_time(candidate, planned=k)`` (``k``: runs of the group-flow
construction so far, this one included; the exposed fetch amortised over
``cost.horizon`` steps) and keeps the least score. Before building a balancing
candidate it checks a lower bound of its score (:func:`lower_bound`, with the
candidate's largest target) and skips it, unbuilt, when the bound cannot beat
the best so far: ``plan.planned`` counts only the candidates actually built,
and ``plan.predicted`` holds the score of every candidate evaluated. The choice
is a pure function of ``(counts, previous (its slots, flows and policy), cost,
options)``: every rank picks the same plan.

Two builders with identical results: ``reference`` (plain Python, the
definition) and ``torch`` (the vectorised backend; the CUDA kernel plans
exact balance only).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, Protocol

import numpy as np
import torch

from moonplan.errors import PlanError
from moonplan.plan.candidates import (
    bounded_name,
    bounded_targets,
    parse_bounded,
    resident_alloc,
    resident_alloc_reference,
)
from moonplan.plan.from_alloc import layout_reference, layout_resident
from moonplan.plan.home import home_map, targets_list
from moonplan.plan.placement import static_alloc, static_load
from moonplan.plan.plan_type import Plan, Predicted, make_plan
from moonplan.plan.reference import reference_plan, to_tensors
from moonplan.plan.torch_backend import plan_torch

EPS = ("0.25", "0.1", "0.05")
"""The ``eps`` of the ``bounded-<eps>`` candidates of ``auto`` (exact decimals)."""

CANDIDATES = ("static", "resident", *(bounded_name(e) for e in EPS), "exact")
"""Candidate names of ``policy="auto"`` (the order they are built in: :func:`balancing_order`)."""


class CostModel(Protocol):
    """What ``policy="auto"`` needs of a cost model (``moonplan.stepcost.StepCost`` has it).

    Planning time must be ``planned * plan_s`` on top of the rest of the step.
    """

    @property
    def plan_s(self) -> float:
        """Planner seconds per planned candidate."""

    def plan_time(self, plan: Plan, *, planned: int = 1) -> Any:
        """Predicted step time of ``plan``; ``.total_s`` is read."""

    def step_time(
        self,
        rows_ER: torch.Tensor,
        sent_RE: torch.Tensor,
        fetch_ER: torch.Tensor,
        src_E: torch.Tensor,
        *,
        planned: int = 1,
    ) -> Any:
        """Predicted step time of an allocation; ``.total_s`` is read."""


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The planner's validated inputs, shared by every candidate."""

    counts_RE: torch.Tensor
    num_slots: int
    align: int
    prev_RB: torch.Tensor | None
    prev_F3: torch.Tensor | None
    backend: str  # "reference" or "torch"
    prev_policy: str | None = None  # the previous plan's policy: auto builds it first


def build(name: str, inp: Inputs) -> Plan:
    """The candidate ``name`` (see the module docstring), recorded as ``plan.policy``."""
    if name == "static":
        return _from_alloc(inp, static_alloc(inp.counts_RE), "static")
    if name == "resident":
        prev_RB = _prev_or_empty(inp)
        if inp.backend == "reference":
            a = resident_alloc_reference(inp.counts_RE.tolist(), prev_RB.tolist())
            alloc_ER = torch.tensor(a, dtype=torch.int64).reshape(inp.counts_RE.shape[::-1])
        else:
            alloc_ER = resident_alloc(inp.counts_RE, prev_RB)
        return _from_alloc(inp, alloc_ER.to(inp.counts_RE.device), "resident")
    if name == "exact":
        return _construct(inp, None, None, "exact")
    eps = parse_bounded(name)
    if eps is None:
        raise PlanError(
            f"unknown policy {name!r}: choose 'exact', 'static', 'resident', "
            "'bounded-<eps>' (eps >= 0, e.g. 'bounded-0.1') or 'auto'"
        )
    return _bounded(inp, name, eps)


def choose(inp: Inputs, cost: CostModel, eps: tuple[str, ...] = EPS) -> Plan:
    """``policy="auto"``: the candidate with the least score (module docstring)."""
    load = _static_load(inp)
    h = horizon_of(cost)
    static = build("static", inp)
    best, best_s = static, score(cost.plan_time(static, planned=0), h)
    times = {"static": best_s}
    if inp.prev_RB is not None:
        cand = build("resident", inp)
        if not torch.equal(cand.alloc, static.alloc):  # else it is the static plan
            times["resident"] = t = score(cost.plan_time(cand, planned=0), h)
            if t < best_s:
                best, best_s = cand, t
    runs = 0
    for name, target, bound in balancing_order(load, inp.prev_policy, eps):
        floor_s = lower_bound(
            cost,
            inp.counts_RE,
            0,
            target=target,
            prev_RB=inp.prev_RB,
            prev_F3=inp.prev_F3,
            horizon=h,
        )
        if floor_s + (runs + 1) * cost.plan_s >= best_s:
            continue  # cannot beat the best so far, even with no traffic at all
        runs += 1
        cand = _construct(inp, target, bound, name)
        times[name] = t = score(cost.plan_time(cand, planned=runs), h)
        if t < best_s:
            best, best_s = cand, t
    return dataclasses.replace(best, predicted=Predicted(times), planned=runs)


def horizon_of(cost: CostModel) -> float:
    """The cost model's ``horizon`` (steps a fetched replica stays resident), 1 if it has none."""
    h = float(getattr(cost, "horizon", 1.0))
    if not (math.isfinite(h) and h >= 1):
        raise PlanError(f"cost.horizon must be a finite number >= 1, got {h!r}")
    return h


def score(t: Any, horizon: float) -> float:
    """The choice's objective: the step time with its exposed fetch amortised over ``horizon``.

    ``t.total_s - t.prefetch_exposed_s * (1 - 1 / horizon)``: a copy made now serves the
    steps its replica stays resident, so only ``1 / horizon`` of the time the step waits
    for it is charged to this step. ``horizon == 1`` scores the step time itself. The
    score is at least the step time with nothing fetched (never below
    :func:`lower_bound`), and equals the step time when nothing is fetched.
    """
    exposed = float(getattr(t, "prefetch_exposed_s", 0.0))
    return float(t.total_s) - exposed * (1.0 - 1.0 / horizon)


def balancing_order(
    load: list[int], prev_policy: str | None, eps: tuple[str, ...] = EPS
) -> list[tuple[str, list[int] | None, int | None]]:
    """The balancing candidates ``(name, targets or None for exact, bound)`` in build order.

    The previous plan's candidate first (it usually wins again: its replicas are
    resident), then ``exact``, then the ``bounded-<eps>`` of :data:`EPS`, largest first.
    A candidate whose targets are the static loads or an earlier one's is left out.
    """
    cands: list[tuple[str, list[int] | None, int | None]] = []
    seen = [load]  # targets already planned (the static loads: nothing to plan)
    for e in eps:
        bounded, cap = bounded_targets(load, Fraction(e))
        if bounded not in seen:  # the same targets give the same plan: plan it once
            seen.append(bounded)
            cands.append((bounded_name(e), bounded, cap))
    exact = targets_list(sum(load), len(load))
    if exact not in seen:
        cands.append(("exact", None, None))
    # exact before the bounded ones; the previous choice before all
    cands.sort(key=lambda c: (c[0] != prev_policy, c[0] != "exact"))
    return cands


def lower_bound(
    cost: CostModel,
    counts_RE: torch.Tensor,
    planned: int,
    *,
    target: list[int] | None = None,
    prev_RB: torch.Tensor | None = None,
    prev_F3: torch.Tensor | None = None,
    horizon: float = 1.0,
) -> float:
    """A lower bound of a balancing candidate's :func:`score`, built with ``planned`` runs.

    ``target``: the candidate's per-rank records (``None``: exact balance);
    ``prev_RB``, ``prev_F3``: the previous plan's slots (its residents need no
    copy) and flows (the construction may replay them).

    The step of two imagined ranks, free of traffic (every row computed where it
    was routed, nothing fetched): rank 0 runs ``k = ceil(A/R)`` experts of one
    row each (``A`` experts with records: some rank of any plan runs at least
    ``k``, each padded to a tile and read once), rank 1 runs the largest target
    in rows of one expert. A ``StepCost`` grows with rows, experts and traffic,
    so the candidate's step time without its fetch is at least this one's. Three
    floors a ``StepCost`` allows on top: the busiest rank's experts
    (:func:`experts_floor`), the dispatch and combine rows a rank
    must send or receive (:func:`link_floor`), and the weight copies a donor
    must send (:func:`fetch_floor`), of which the score charges ``1/horizon``
    of the part the step waits for. Only the ``k`` imagined experts are passed,
    so the bound costs little next to scoring a plan.
    """
    R = counts_RE.shape[0]
    dev = counts_RE.device
    T_E = counts_RE.sum(0)
    k = -(-int((T_E > 0).sum()) // R)
    rows_KR = torch.zeros(max(k, 1), R, dtype=torch.int64, device=dev)  # imagined experts
    rows_KR[:k, 0] = 1
    if R > 1:
        rows_KR[0, 1] = -(-int(T_E.sum()) // R) if target is None else max(target)
    sent_RK = rows_KR.t().contiguous()  # every row stays on the rank that routed it
    fetch_KR = torch.zeros(rows_KR.shape, dtype=torch.bool, device=dev)
    src_K = torch.zeros(rows_KR.shape[0], dtype=torch.int64, device=dev)
    free = cost.step_time(rows_KR, sent_RK, fetch_KR, src_K, planned=planned)
    floor = experts_floor(cost, counts_RE, target, prev_F3)
    lift = max(0.0, floor - float(getattr(free, "experts_s", math.inf)))
    d_link, c_link = link_floor(cost, counts_RE, target, prev_F3)
    without = float(free.total_s) + lift + d_link + c_link
    fetch = fetch_floor(cost, counts_RE, target, prev_RB)
    if fetch <= 0:
        return without
    if getattr(cost, "overlap", False):  # the receiver waits for the copy, then runs its rows
        rates = [float(getattr(cost, n, 0.0)) for n in ("weight_read_s", "row_mem_s", "row_flop_s")]
        one = max(rates[0] + rates[1], rates[2] * int(getattr(cost, "tile_rows", 1)))
        comb = float(getattr(free, "combine_s", 0.0)) + c_link
        total = max(without, planned * cost.plan_s + fetch + one + comb)
    else:  # serial: the fetch adds to the step
        total = without + fetch
    return without + (total - without) / horizon


def fetch_floor(
    cost: CostModel,
    counts_RE: torch.Tensor,
    target: list[int] | None = None,
    prev_RB: torch.Tensor | None = None,
) -> float:
    """Seconds of the weight copies a balancing candidate towards ``target`` makes at least.

    Every replica pair ``(e, r)`` carries at most ``T_e`` records. A donor ``d``
    (static load above its target by ``X_d``) sheds at least ``X_d`` records of
    its home experts, so it feeds at least ``ceil(X_d / max T_e of its experts)``
    pairs; a receiver ``r`` (below its target by ``Y_r``) keeps its home records
    and takes ``Y_r``, so at least ``ceil(Y_r / max T_e of other ranks' experts)``
    pairs. Each pair is a copy
    unless resident in ``prev_RB``: minus the resident pairs of ``d``'s experts
    (of ``r``'s slots). The busiest rank's copies cost ``base_latency_s`` plus
    ``copy_s_intra`` each in one fast-link domain, or the best split over both
    link classes across domains. Read from a ``StepCost``'s fields; 0 for a
    cost model without them.
    """
    names = ("copy_s_intra", "copy_s_inter", "base_latency_s", "domain_size")
    R = counts_RE.shape[0]
    if R <= 1 or not all(hasattr(cost, n) for n in names):
        return 0.0
    _, home_E, T_E, load_R, t_R = _host(counts_RE, target)
    X_R = load_R - t_R
    if int((-X_R).max()) <= 0:
        return 0.0  # no rank below its target: nothing moves
    own_max_R = np.zeros(R, dtype=np.int64)
    np.maximum.at(own_max_R, home_E, T_E)
    top2 = np.sort(own_max_R)[-2:] if R > 1 else np.zeros(2, dtype=np.int64)
    other_max_R = np.where(own_max_R == top2[-1], top2[0], top2[-1]).clip(min=1)
    per_pair_R = own_max_R.clip(min=1)
    give_R = (X_R.clip(min=0) + per_pair_R - 1) // per_pair_R
    take_R = ((-X_R).clip(min=0) + other_max_R - 1) // other_max_R
    if prev_RB is not None:
        slot_RB = host_int64(prev_RB)
        r_N, j_N = (slot_RB >= 0).nonzero()
        d_N = home_E[slot_RB[r_N, j_N]]
        away = d_N != r_N  # resident pairs (expert of d_N, rank r_N)
        give_R = give_R - np.bincount(d_N[away], minlength=R)
        take_R = take_R - np.bincount(r_N[away], minlength=R)
    need_R = np.maximum(give_R, take_R)
    n = int(need_R.max())
    if n <= 0:
        return 0.0
    a, b = _rate(cost, "copy_s_intra"), _rate(cost, "copy_s_inter")
    per = a if _domain_size(cost, R) >= R else (a * b / (a + b) if a > 0 and b > 0 else 0.0)
    return _rate(cost, "base_latency_s") + n * per


def _keeps_home(load_R: np.ndarray, t_R: np.ndarray, prev_F3: torch.Tensor | None) -> np.ndarray:
    """bool ``[R]``: ranks that never give (static load at most the target, no donor of
    a previous flow, which the construction may replay: ``moonplan/plan/reference.py``)."""
    keeps_R = load_R <= t_R
    if prev_F3 is not None:
        d_F = host_int64(prev_F3)[:, 0]
        keeps_R[d_F[d_F >= 0]] = False
    return keeps_R


def host_int64(a: torch.Tensor) -> np.ndarray:
    """``a`` on the host as an int64 numpy array (the floors are a few small vectors)."""
    return a.detach().cpu().numpy().astype(np.int64)


def _host(counts_RE: torch.Tensor, target: list[int] | None) -> tuple[np.ndarray, ...]:
    """Host int64 ``counts_RE``, ``home_E``, ``T_E``, static ``load_R`` and targets ``t_R``."""
    c = host_int64(counts_RE)
    R, E = c.shape
    home_E = host_int64(home_map(E, R))
    T_E = c.sum(0)
    load_R = np.bincount(home_E, weights=T_E, minlength=R).astype(np.int64)
    N = int(T_E.sum())
    t_R = np.asarray(targets_list(N, R) if target is None else target, dtype=np.int64)
    return c, home_E, T_E, load_R, t_R


def experts_floor(
    cost: CostModel,
    counts_RE: torch.Tensor,
    target: list[int] | None = None,
    prev_F3: torch.Tensor | None = None,
) -> float:
    """Expert seconds the busiest rank of a balancing candidate towards ``target`` pays at least.

    Two floors, the larger holds. The ranks' mean: over all ranks, tile-padded
    rows are at least ``sum_e tile(T_e)`` (an expert split over ranks pads once
    per part), weights are read at least once per expert with records (``A``)
    and every record is a row. A rank whose static load is at most its target
    (``target``, ``None``: exact balance) and was no donor of a ``prev_F3`` flow
    keeps every record of its home experts (``moonplan/plan/README.md``: only
    donors give, only ranks short of their target are filled, and the
    construction may replay a previous flow from its donor) and receives
    ``t_r - L_r`` rows of at least
    one more expert: its home experts' padded rows plus those, its home experts
    with records (plus one) read. Read from a ``StepCost``'s rate fields; a cost
    model without them gets 0.
    """
    names = ("row_flop_s", "weight_read_s", "row_mem_s", "tile_rows")
    if not all(hasattr(cost, n) for n in names):
        return 0.0
    R = counts_RE.shape[0]
    _, home_E, T_E, load_R, t_R = _host(counts_RE, target)
    N = int(T_E.sum())
    tile = int(_rate(cost, "tile_rows"))
    flop_s, read_s = _rate(cost, "row_flop_s"), _rate(cost, "weight_read_s")
    mem_s = _rate(cost, "row_mem_s")
    pad_E = (T_E + tile - 1) // tile * tile
    mean = max(flop_s * int(pad_E.sum()) / R, (read_s * int((T_E > 0).sum()) + mem_s * N) / R)
    keeps = _keeps_home(load_R, t_R, prev_F3)
    if not bool(keeps.any()):
        return mean
    extra_R = t_R - load_R
    flop_R = flop_s * (np.bincount(home_E, weights=pad_E, minlength=R) + extra_R)
    groups_R = np.bincount(home_E, weights=T_E > 0, minlength=R) + (extra_R > 0)
    mem_R = read_s * groups_R + mem_s * t_R
    return max(mean, float(np.maximum(flop_R, mem_R)[keeps].max()))


def link_floor(
    cost: CostModel,
    counts_RE: torch.Tensor,
    target: list[int] | None = None,
    prev_F3: torch.Tensor | None = None,
) -> tuple[float, float]:
    """Dispatch and combine link seconds a balancing candidate towards ``target`` pays at least.

    ``target``: the candidate's per-rank records (``None``: exact balance). In
    the group-flow construction (``moonplan/plan/README.md``) every rank is
    filled by at most one flow, of one donor group's experts, only ranks below
    their target are filled, and a rank whose static load ``L_r`` is at most its
    target never gives (unless it was the donor of a ``prev_F3`` flow, which may
    be replayed): it keeps its home records and receives exactly ``t_r - L_r``.
    So rank ``r`` computes at most ``keep_r = own_r + g_r`` of its own rows
    (``own_r``: its rows to its home experts; ``g_r = max_{d != r}
    group_{r,d}``, its rows to the home experts of ``d``, capped at ``t_r - L_r``
    for such a rank: 0 when ``L_r == t_r``), and both sends and receives
    at least ``max(S_r, t_r) - keep_r`` rows (``S_r``: rows it routes).
    A link time is at least ``n * a`` in one fast-link domain (``a``: the intra
    rate) and ``n * a * b / (a + b)`` across domains (the best split of ``n``
    over both link classes, ``b`` the inter rate). Read from a ``StepCost``'s rate
    fields; a cost model without them gets ``(0, 0)`` (the traffic-free bound alone).
    """
    R = counts_RE.shape[0]
    names = (
        "dispatch_row_s_intra",
        "dispatch_row_s_inter",
        "combine_row_s_intra",
        "combine_row_s_inter",
    )
    if R <= 1 or not all(hasattr(cost, n) for n in names) or not hasattr(cost, "domain_size"):
        return 0.0, 0.0
    c, home_E, _, load_R, t_R = _host(counts_RE, target)
    group_RR = c @ (home_E[:, None] == np.arange(R)[None, :]).astype(np.int64)  # [s, d]
    own_R = group_RR.diagonal().copy()
    np.fill_diagonal(group_RR, 0)
    group_R = group_RR.max(1)
    keeps_R = _keeps_home(load_R, t_R, prev_F3)
    keep_R = own_R + np.where(keeps_R, np.minimum(group_R, t_R - load_R), group_R)
    n = float((np.maximum(c.sum(1), t_R) - keep_R).max())
    one_domain = int(_domain_size(cost, R)) >= R
    out = []
    for intra_n, inter_n in (names[:2], names[2:]):
        a, b = float(getattr(cost, intra_n)), float(getattr(cost, inter_n))
        rate = a if one_domain else (a * b / (a + b) if a > 0 and b > 0 else 0.0)
        out.append(max(0.0, n) * rate)
    return out[0], out[1]


def _rate(cost: CostModel, name: str) -> float:
    """A ``StepCost`` field the floors read (callers check it exists)."""
    return float(getattr(cost, name))


def _domain_size(cost: CostModel, num_ranks: int) -> int:
    return int(getattr(cost, "domain_size")(num_ranks))  # noqa: B009 (not in CostModel)


def _static_load(inp: Inputs) -> list[int]:
    return static_load(inp.counts_RE).tolist()


def _prev_or_empty(inp: Inputs) -> torch.Tensor:
    if inp.prev_RB is not None:
        return inp.prev_RB
    R = inp.counts_RE.shape[0]
    return torch.full((R, inp.num_slots), -1, dtype=torch.int64, device=inp.counts_RE.device)


def _from_alloc(inp: Inputs, alloc_ER: torch.Tensor, policy: str) -> Plan:
    """A plan executing ``alloc_ER``, whose replicas (static: none) all sit in resident slots."""
    if inp.backend == "reference":
        fields = layout_reference(inp.counts_RE, alloc_ER, inp.num_slots, inp.align, inp.prev_RB)
    else:
        fields = layout_resident(alloc_ER, inp.num_slots, inp.align, inp.prev_RB)
    top = int(fields["target"].max())
    return make_plan(
        fields,
        counts=inp.counts_RE,
        num_slots=inp.num_slots,
        align=inp.align,
        backend=inp.backend,
        policy=policy,
        planned=0,
        declared_bound=top,
    )


def _construct(inp: Inputs, target: list[int] | None, bound: int | None, policy: str) -> Plan:
    """The planner's group-flow construction towards ``target`` (``None``: exact)."""
    c = inp.counts_RE
    if inp.backend == "reference":
        prev_slots = None if inp.prev_RB is None else inp.prev_RB.tolist()
        prev_flows = (
            None if inp.prev_F3 is None else [tuple(f) for f in inp.prev_F3.tolist() if f[0] >= 0]
        )
        res = reference_plan(c.tolist(), inp.num_slots, inp.align, prev_slots, prev_flows, target)
        fields = to_tensors(res, c.device)
    else:
        target_R = None
        if target is not None:
            target_R = torch.tensor(target, dtype=torch.int64, device=c.device)
        fields = plan_torch(
            c, inp.num_slots, inp.align, inp.prev_RB, inp.prev_F3, target_R=target_R
        )
    return make_plan(
        fields,
        counts=c,
        num_slots=inp.num_slots,
        align=inp.align,
        backend=inp.backend,
        policy=policy,
        planned=1,
        declared_bound=bound,
    )


def _bounded(inp: Inputs, name: str, eps: Fraction) -> Plan:
    target, cap = bounded_targets(_static_load(inp), eps)
    return _construct(inp, target, cap, name)
