"""``policy=`` of :func:`moonplan.plan`: build one named candidate, or choose among them (``auto``).

Legend:
    R ranks, E experts, B slots, N records in all
    counts_RE   int64 [R, E] validated router counts
    prev_RB     int64 [R, B] previous plan's slots (or None), prev_F3 its flows

Candidates are the entries of :data:`TABLE` (one :class:`Candidate` each: its
builder, how ``auto`` bounds its score, whether ``auto`` considers it), evaluated in
this order (ties go to the earlier one):

``static`` and ``resident`` (only with ``previous=``, and only when it moves
records) first: they fetch nothing and need no planner run, so they are scored
from their allocations (``cost.step_time``) and built only if they win. Then
the balancing candidates (:func:`screened_order`): the previous plan's
candidate (``previous.policy``) first, as it usually wins again, then
``exact``, then ``bounded-<eps>`` for ``eps`` in :data:`EPS` (largest first).
A balancing candidate whose targets equal the static loads or another
candidate's targets is skipped: it would be the same plan, planned again.
Last, with ``previous=``, ``greedy``: the MoonEP greedy's allocation (the
construction without ``previous=``), its slots reusing the residents.

``auto`` scores each candidate with :func:`score` of
``cost.plan_time(candidate, planned=k)`` (``k``: planner runs so far, this one
included; the exposed fetch amortised over ``cost.horizon`` steps) and keeps
the least score. A balancing candidate marked ``construct`` is scored from its
allocation alone (``moonplan.plan.score_alloc``: the same time, without laying it
out) and only the winner is built (:func:`decide`; ``choose(..., lean=False)``
builds every scored candidate, the same plan bit for bit); the choose-ahead search
(``moonplan.plan.search``) builds none. Before building a balancing candidate it
checks a lower bound of its score (``moonplan.plan.screen.lower_bound``: the construction's group
flows, decided from the counts alone, and what every plan with those flows
pays) and skips it, unbuilt, when the bound plus the runs cannot beat the best
so far: ``plan.planned`` counts only the candidates actually built, and
``plan.predicted`` holds the score of every candidate evaluated. ``plan.chose``
is the choice's own work beyond those runs (the setup, each screen, each score,
in construction equivalents: :data:`WORK`), which the simulator charges too.

Between full choices ``auto`` keeps the previous plan's candidate (:func:`keeps`:
at most ``basis.every - 1`` steps, and only while no static load moved further
than the runner-up's lead over the winner allows), building only it
(``plan.basis`` carries what the last full choice saw). The choice is a pure
function of ``(counts, previous (its slots, flows, policy and basis), cost,
options)``: every rank picks the same plan.

Two builders with identical results: ``reference`` (plain Python, the
definition) and ``torch`` (the vectorised backend; the CUDA kernel plans
exact balance only).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
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
from moonplan.plan.from_alloc import layout_reference, layout_resident, layout_torch
from moonplan.plan.home import home_map, targets_list
from moonplan.plan.keep import gap, keeps, refresh_every
from moonplan.plan.placement import static_alloc, static_load
from moonplan.plan.plan_type import Basis, Plan, Predicted, make_plan
from moonplan.plan.reference import reference_fields
from moonplan.plan.score_alloc import Context
from moonplan.plan.screen import Step, lower_bound
from moonplan.plan.torch_backend import alloc_torch, plan_torch

EPS = ("0.25", "0.1", "0.05")
"""The ``eps`` of the ``bounded-<eps>`` candidates of ``auto`` (exact decimals)."""

GREEDY = "greedy"
"""The MoonEP greedy's allocation as a candidate (:func:`build`)."""

Targets = tuple[list[int] | None, int | None]
"""A balancing candidate's per-rank targets (``None``: exact balance) and declared bound."""


WORK = {"setup": 1.5, "screen": 0.45, "score": 0.55, "keep": 0.2}
"""The choice's own work in construction equivalents (CPU host time of this code over
one group-flow construction, torch builder, ``bench/bench_auto_sweep.py --paths``; the
largest ratio measured over its cases, rounded up): ``setup`` once per full choice
(static and resident allocations, :class:`~moonplan.plan.screen.Step`, the candidate
order, the chosen plan's layout), ``screen`` per lower bound, ``score`` per predicted
step time, ``keep`` for a step that keeps the previous choice (:func:`keeps`)."""


class CostModel(Protocol):
    """What ``policy="auto"`` needs of a cost model (``moonplan.stepcost.StepCost`` has it).

    Planning time must be ``planned * plan_s`` on top of the rest of the step, and
    ``plan_time(plan)`` the ``step_time`` of the plan's allocation, counts, fetched pairs
    and home map (``static`` and ``resident`` are scored from their allocations).
    """

    @property
    def plan_s(self) -> float:
        """Planner seconds per planned candidate."""

    def plan_time(self, plan: Plan, *, planned: int = 1) -> Any:
        """Predicted step time of ``plan``; ``.total_s`` is read."""

    def step_time(
        self,
        rows_ER: torch.Tensor | np.ndarray,
        sent_RE: torch.Tensor | np.ndarray,
        fetch_ER: torch.Tensor | np.ndarray,
        src_E: torch.Tensor | np.ndarray,
        *,
        planned: int = 1,
    ) -> Any:
        """Predicted step time of an allocation (int64 tensors or host numpy arrays, the
        fetched pairs bool; ``auto`` passes numpy arrays); ``.total_s`` is read."""


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
    prev_basis: Basis | None = None  # the previous plan's basis: auto may keep its choice

    @functools.cached_property
    def static_load(self) -> list[int]:
        """``[R]`` the static loads (records of each rank's home experts; one host read,
        made once and shared by the choice and the builders; read-only)."""
        return static_load(self.counts_RE).tolist()


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One entry of the candidate table (:data:`TABLE`): a new candidate is one builder
    and one entry (CONTRIBUTING.md, "Adding a planner policy").

    Attributes:
        name: its ``policy=`` name, recorded as ``plan.policy``.
        build: ``inputs -> Plan``, the plan itself (``policy=name``, or ``auto``'s winner).
        auto: whether ``policy="auto"`` considers it (``build`` serves ``policy=name``
            either way).
        alloc: for a candidate that fetches nothing and runs no planner (every replica
            resident): ``inputs -> alloc_ER`` (``None``: not a candidate this step).
            ``auto`` scores it from the allocation, exactly, and if it wins lays out that
            allocation (``_from_alloc``, what its ``build`` returns too) without asking
            for it again.
        targets: for a balancing candidate (one group-flow construction):
            ``(static loads, inputs or None) -> Targets`` (``None``: not a candidate this
            step; the inputs are ``None`` when only the loads are known).
            ``auto`` bounds its score from below from these targets
            (``moonplan.plan.screen.lower_bound``) and builds it only if the bound,
            plus its run, can beat the best so far. A candidate whose targets are the
            static loads, or an earlier one's, is left out.
        replay: its construction replays ``previous``'s flows (``False``: it plans
            without ``previous``, and its replicas still reuse the residents).
        first: tried before the other balancing candidates (after the previous plan's).
        construct: its plan's allocation is the group-flow construction towards its
            targets (with ``previous``'s flows where it replays them): ``auto`` then
            scores it from that allocation (``moonplan.plan.score_alloc``) and builds
            it only if it wins. ``False``: ``auto`` builds it to score it.
    """

    name: str
    build: Callable[[Inputs], Plan]
    auto: bool = True
    alloc: Callable[[Inputs], torch.Tensor | None] | None = None
    targets: Callable[[list[int], Inputs | None], Targets | None] | None = None
    replay: bool = True
    first: bool = False
    construct: bool = False


def build(name: str, inp: Inputs, table: tuple[Candidate, ...] | None = None) -> Plan:
    """The candidate ``name`` of ``table`` (default :data:`TABLE`; any ``bounded-<eps>``),
    recorded as ``plan.policy``."""
    for cand in TABLE if table is None else table:
        if cand.name == name:
            return cand.build(inp)
    eps = parse_bounded(name)
    if eps is None:
        raise PlanError(
            f"unknown policy {name!r}: choose 'exact', 'static', 'resident', 'greedy', "
            "'bounded-<eps>' (eps >= 0, e.g. 'bounded-0.1') or 'auto'"
        )
    return _bounded(inp, name, eps)


def choose(
    inp: Inputs, cost: CostModel, table: tuple[Candidate, ...] | None = None, *, lean: bool = True
) -> Plan:
    """``policy="auto"`` among ``table``'s candidates (default :data:`TABLE`): the previous
    choice kept where :func:`keeps` allows it, else the least score (module docstring).

    ``lean=True`` scores the balancing candidates from their allocations
    (:func:`decide`) and builds only the winner; ``lean=False`` builds every candidate it
    scores (the readable reference: the same plan, bit for bit, ``tests/plan``).
    """
    table = TABLE if table is None else table
    load = inp.static_load
    if keeps(inp, load, cost):
        return _kept(inp, table)
    d = decide(inp, cost, load, table, lean=lean)
    best = d.plan
    if best is None and d.alloc is not None:  # a fetch-free candidate's scored allocation
        best = _from_alloc(inp, d.alloc, d.name)
    elif best is None:
        best = build(d.name, inp, table)
    return dataclasses.replace(
        best, predicted=d.predicted, planned=d.planned, chose=d.chose, basis=d.basis
    )


def _kept(inp: Inputs, table: tuple[Candidate, ...]) -> Plan:
    """The previous plan's candidate, built for these counts (no screen, no score)."""
    assert inp.prev_basis is not None and inp.prev_policy is not None
    p = build(inp.prev_policy, inp, table)
    return dataclasses.replace(p, chose=WORK["keep"], basis=kept_basis(inp.prev_basis))


def kept_basis(basis: Basis) -> Basis:
    """The basis of a step that keeps the choice ``basis`` records (one more kept step)."""
    return dataclasses.replace(basis, kept=basis.kept + 1)


@dataclasses.dataclass(frozen=True)
class Decision:
    """A full choice's outcome (:func:`decide`).

    Attributes:
        name: the winning candidate.
        plan: the winner's plan where the choice built it to score it, else ``None``.
        alloc: the winner's allocation ``[E, R]`` where it is a fetch-free candidate
            (scored from it, never built), else ``None``.
        predicted, planned, chose, basis: what the chosen plan records (:class:`Plan`).
        cut: balancing candidates left out because the work budget ran out (not
            screened, or screened and not scored; :func:`decide`'s ``budget``; 0 without
            one).
    """

    name: str
    plan: Plan | None
    alloc: torch.Tensor | None
    predicted: Predicted
    planned: int
    chose: float
    basis: Basis
    cut: int = 0


def decide(
    inp: Inputs,
    cost: CostModel,
    load: list[int],
    table: tuple[Candidate, ...],
    *,
    lean: bool,
    budget: float | None = None,
) -> Decision:
    """Every candidate screened or scored; the least score wins (module docstring).

    ``lean``: score a balancing candidate marked ``construct`` from its allocation
    (``moonplan.plan.score_alloc``: the same score as its built plan's, without its
    slots and rows, on host values shared by the whole choice); otherwise, and for the
    other candidates, build it and score the plan.

    ``budget``: the most work (construction equivalents, :data:`WORK`, planner runs
    included) the choice may spend; ``None``: no limit. The fetch-free candidates and
    the setup are always spent; the balancing candidates are taken in build order
    while the next screen (and, if it passes, the next run and score) fits, and the
    rest are left out (``Decision.cut``). A cut choice records no lead over the
    runner-up (``basis.gap_s = 0``), so it is never kept: the next search chooses
    again. The choose-ahead search passes the work that fits beside the steps it runs
    beside (``moonplan.plan.ahead``), so that a search heavier than forecast narrows
    instead of making the step it names wait.
    """
    h = horizon_of(cost)
    order = screened_order(load, inp, table)
    # one host view of the counts and previous per choice: the screens' and the scores'
    step = Step.of(inp.counts_RE, inp.prev_RB, inp.prev_F3) if order or lean else None
    ctx = Context.of_step(step, inp.prev_RB, inp.prev_F3) if lean and step else None
    fixed = _fetchless(inp, table)  # no copy, no planner run: scored from their
    times = {n: score(_fetchless_time(cost, inp, a, ctx), h) for n, a in fixed.items()}
    best_name = min(times, key=lambda n: times[n])  # ties: the earlier one
    best: Plan | None = None
    best_s = times[best_name]
    runs = 0
    floors: dict[str, float] = {}  # the screened-out candidates' least possible scores
    builders = {c.name: c for c in table}
    screened = 0

    def spent() -> float:  # the work so far, runs included
        return WORK["setup"] + screened * WORK["screen"] + len(times) * WORK["score"] + runs

    for name, target, _ in order:
        if budget is not None and spent() + WORK["screen"] > budget:
            break
        screened += 1
        floor_s = lower_bound(
            cost,
            inp.counts_RE,
            0,
            target=target,
            prev_RB=inp.prev_RB,
            prev_F3=inp.prev_F3,
            horizon=h,
            replay=builders[name].replay,
            step=step,
        )
        if floor_s + (runs + 1) * cost.plan_s >= best_s:
            floors[name] = floor_s + (runs + 1) * cost.plan_s
            continue  # cannot beat the best so far
        if budget is not None and spent() + WORK["score"] + 1 > budget:
            break  # screened (counted), not scored: no room for its run and score
        runs += 1
        st, built = _evaluate(builders[name], inp, cost, (target, runs), ctx)
        times[name] = t = score(st, h)
        if t < best_s:
            best_name, best, best_s = name, built, t
    work = spent() - runs
    every = refresh_every((runs + work) * cost.plan_s, best_s)
    cut = len(order) - len(floors) - (len(times) - len(fixed))
    lead = gap(best_s, {**floors, **times}) if cut == 0 else 0.0
    basis = Basis(tuple(load), lead, every=every)
    alloc = fixed.get(best_name) if best is None else None
    return Decision(best_name, best, alloc, Predicted(times), runs, work, basis, cut)


def _evaluate(
    cand: Candidate,
    inp: Inputs,
    cost: CostModel,
    target_runs: tuple[list[int] | None, int],
    ctx: Context | None,
) -> tuple[Any, Plan | None]:
    """``(cost's time, the plan or None)`` of the balancing candidate ``cand`` towards
    ``target``, charged ``runs`` planner runs (``target_runs``): from its allocation alone
    where ``ctx`` (the lean choice's :class:`~moonplan.plan.score_alloc.Context`) and
    ``cand.construct`` allow it (no plan), else from its built plan."""
    target, runs = target_runs
    if ctx is not None and cand.construct:
        alloc_ER = ctx.alloc(target, cand.replay, inp.backend)
        return ctx.time(cost, alloc_ER, runs), None
    p = cand.build(inp)
    return cost.plan_time(p, planned=runs), p


def _fetchless_time(
    cost: CostModel, inp: Inputs, alloc_ER: torch.Tensor, ctx: Context | None = None
) -> Any:
    """``cost``'s time of a plan of ``alloc_ER`` that fetches nothing (static, resident:
    every replica resident), without building it: ``plan_time`` of the built plan is
    ``step_time`` of its allocation, counts, no fetched pair and the home map (the
    host arrays of ``ctx``, where given)."""
    E, R = alloc_ER.shape
    if ctx is not None:
        a_ER = alloc_ER.cpu().numpy()
        none_ER = np.zeros((E, R), dtype=bool)
        return cost.step_time(a_ER, ctx.counts_RE, none_ER, ctx.home_E, planned=0)
    fetch_ER = torch.zeros(E, R, dtype=torch.bool)
    return cost.step_time(alloc_ER, inp.counts_RE, fetch_ER, home_map(E, R), planned=0)


def _resident_alloc(inp: Inputs) -> torch.Tensor:
    """The ``resident`` allocation ``[E, R]`` on the counts' device (by the backend's builder)."""
    prev_RB = _prev_or_empty(inp)
    if inp.backend == "reference":
        a = resident_alloc_reference(inp.counts_RE.tolist(), prev_RB.tolist())
        alloc_ER = torch.tensor(a, dtype=torch.int64).reshape(inp.counts_RE.shape[::-1])
    else:
        alloc_ER = resident_alloc(inp.counts_RE, prev_RB)
    return alloc_ER.to(inp.counts_RE.device)


def _fetchless(inp: Inputs, table: tuple[Candidate, ...]) -> dict[str, torch.Tensor]:
    """The allocations of ``table``'s fetch-free candidates this step, in table order; one
    equal to an earlier one's is left out (it would be the same plan)."""
    out: dict[str, torch.Tensor] = {}
    for cand in table:
        a = cand.alloc(inp) if cand.auto and cand.alloc is not None else None
        if a is not None and not any(torch.equal(a, b) for b in out.values()):
            out[cand.name] = a
    return out


def screened_order(
    load: list[int], inp: Inputs, table: tuple[Candidate, ...] | None = None
) -> list[tuple[str, list[int] | None, int | None]]:
    """``auto``'s balancing candidates this step ``(name, targets or None for exact, bound)``
    in build order: those that replay ``previous`` (:func:`balancing_order`), then the others
    in table order."""
    table = TABLE if table is None else table
    out = balancing_order(load, inp.prev_policy, table, inp)
    for cand in table:
        t = _targets(cand, load, inp, replay=False)
        if t is not None and t[0] != load:  # targets equal to the static loads: no plan
            out.append((cand.name, *t))
    return out


def _targets(cand: Candidate, load: list[int], inp: Inputs | None, replay: bool) -> Targets | None:
    if not cand.auto or cand.targets is None or cand.replay is not replay:
        return None
    return cand.targets(load, inp)


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
    load: list[int],
    prev_policy: str | None,
    table: tuple[Candidate, ...] | None = None,
    inp: Inputs | None = None,
) -> list[tuple[str, list[int] | None, int | None]]:
    """The balancing candidates that replay ``previous`` ``(name, targets or None for exact,
    bound)`` in build order.

    The previous plan's candidate first (it usually wins again: its replicas are
    resident), then those marked ``first`` (``exact``), then the table's order. A
    candidate whose targets are the static loads or an earlier one's (table order) is
    left out: the same targets give the same plan.
    """
    cands: list[tuple[str, list[int] | None, int | None]] = []
    seen = [load]  # targets already planned (the static loads: nothing to plan)
    exact = targets_list(sum(load), len(load))
    first = set()
    for cand in TABLE if table is None else table:
        t = _targets(cand, load, inp, replay=True)
        if t is None or (exact if t[0] is None else t[0]) in seen:
            continue
        seen.append(exact if t[0] is None else t[0])
        cands.append((cand.name, *t))
        first |= {cand.name} if cand.first else set()
    cands.sort(key=lambda c: (c[0] != prev_policy, c[0] not in first))
    return cands


def _prev_or_empty(inp: Inputs) -> torch.Tensor:
    if inp.prev_RB is not None:
        return inp.prev_RB
    R = inp.counts_RE.shape[0]
    return torch.full((R, inp.num_slots), -1, dtype=torch.int64, device=inp.counts_RE.device)


def _from_alloc(
    inp: Inputs, alloc_ER: torch.Tensor, policy: str, planned: int = 0, moves: bool = False
) -> Plan:
    """A plan executing ``alloc_ER`` (slots: ``previous``'s residents kept), built with
    ``planned`` planner runs; ``moves=False``: every replica is resident (static, resident)."""
    B, align, prev_RB = inp.num_slots, inp.align, inp.prev_RB
    if inp.backend == "reference":
        fields = layout_reference(inp.counts_RE, alloc_ER, B, align, prev_RB)
    elif moves:
        fields = layout_torch(alloc_ER, B, align, prev_RB)
    else:
        fields = layout_resident(alloc_ER, B, align, prev_RB)
    return _make(inp, fields, policy, planned, int(fields["target"].max()))


def _make(
    inp: Inputs, fields: dict[str, torch.Tensor], policy: str, planned: int, bound: int | None
) -> Plan:
    """The :class:`Plan` of a candidate's fields (``bound``: its declared load bound)."""
    return make_plan(
        fields,
        counts=inp.counts_RE,
        num_slots=inp.num_slots,
        align=inp.align,
        backend=inp.backend,
        policy=policy,
        planned=planned,
        declared_bound=bound,
    )


def _construct(inp: Inputs, target: list[int] | None, bound: int | None, policy: str) -> Plan:
    """The planner's group-flow construction towards ``target`` (``None``: exact)."""
    c = inp.counts_RE
    if inp.backend == "reference":
        prev = (inp.prev_RB, inp.prev_F3)
        fields = reference_fields(c, inp.num_slots, inp.align, prev, target=target, device=c.device)
    else:
        target_R = None
        if target is not None:
            target_R = torch.tensor(target, dtype=torch.int64, device=c.device)
        fields = plan_torch(
            c, inp.num_slots, inp.align, inp.prev_RB, inp.prev_F3, target_R=target_R
        )
    return _make(inp, fields, policy, 1, bound)


def _greedy(inp: Inputs) -> Plan:
    """The MoonEP greedy's allocation (``moonplan.baselines.moonep_greedy``, written from
    its description) laid out with ``previous``'s residents kept: the group-flow
    construction without ``previous=`` is that greedy, step for step (the donor with the
    largest excess fills the largest deficit completely; the largest quota takes from the
    fullest expert), so it is built with the planner's own code. One planner run."""
    c = inp.counts_RE
    if inp.backend == "reference":
        alloc_ER = reference_fields(c, inp.num_slots, 1, device=c.device)["alloc"]
    else:
        alloc_ER = alloc_torch(c)
    return _from_alloc(inp, alloc_ER, GREEDY, planned=1, moves=True)


def _bounded(inp: Inputs, name: str, eps: Fraction) -> Plan:
    target, cap = bounded_targets(inp.static_load, eps)
    return _construct(inp, target, cap, name)


def _exact_targets(load: list[int], inp: Inputs | None) -> Targets:
    return None, None


def _bounded_targets(eps: str) -> Callable[[list[int], Inputs | None], Targets]:
    def targets(load: list[int], inp: Inputs | None) -> Targets:
        return bounded_targets(load, Fraction(eps))

    return targets


def _greedy_targets(load: list[int], inp: Inputs | None) -> Targets | None:
    """Exact balance without ``previous`` (the greedy's allocation is exact's without one:
    ``tests/plan``), so only with a previous plan."""
    return (None, None) if inp is not None and inp.prev_RB is not None else None


def _resident_or_none(inp: Inputs) -> torch.Tensor | None:
    return _resident_alloc(inp) if inp.prev_RB is not None else None


def _bounded_entry(eps: str) -> Candidate:
    name = bounded_name(eps)
    return Candidate(name, lambda inp: _bounded(inp, name, Fraction(eps)),
                     targets=_bounded_targets(eps), construct=True)  # fmt: skip


TABLE: tuple[Candidate, ...] = (
    Candidate("static", lambda inp: _from_alloc(inp, static_alloc(inp.counts_RE), "static"),
              alloc=lambda inp: static_alloc(inp.counts_RE)),
    Candidate("resident", lambda inp: _from_alloc(inp, _resident_alloc(inp), "resident"),
              alloc=_resident_or_none),
    *(_bounded_entry(e) for e in EPS),
    Candidate("exact", lambda inp: _construct(inp, None, None, "exact"),
              targets=_exact_targets, first=True, construct=True),
    Candidate(GREEDY, _greedy, targets=_greedy_targets, replay=False, construct=True),
)  # fmt: skip
"""The planner's candidates, in evaluation order (module docstring): ``policy=<name>``
builds one, ``policy="auto"`` chooses among those marked ``auto``. Immutable: a test or
an experiment passes its own table to :func:`choose` and :func:`build`."""

CANDIDATES = tuple(c.name for c in TABLE)
"""Candidate names of ``policy="auto"`` (:data:`TABLE`'s)."""
