"""``policy=`` of :func:`moonplan.plan`: build one named candidate, or choose among them (``auto``).

Legend:
    R ranks, E experts, B slots, N records in all
    counts_RE   int64 [R, E] validated router counts
    prev_RB     int64 [R, B] previous plan's slots (or None), prev_F3 its flows

Candidates, in the fixed order they are evaluated and ties are broken (the
cheapest plan first, so it wins a tie):

``static``, ``resident`` (only with ``previous=``, and only when it moves
records), ``bounded-<eps>`` for ``eps`` in :data:`EPS` (largest first), ``exact``.
A balancing candidate whose targets equal the static loads or an earlier
candidate's targets is skipped: it would be the same plan, planned again.

``auto`` evaluates ``cost.plan_time(candidate, planned=k)`` (``k``: runs of
the group-flow construction so far, this one included) and keeps the least
total, first in order on ties. Before building a balancing candidate it checks
a lower bound of that candidate's time (:func:`lower_bound`) and skips it when
the bound cannot beat the best so far. The choice is a pure function of
``(counts, previous, cost, options)``: every rank picks the same plan.

Two builders with identical results: ``reference`` (plain Python, the
definition) and ``torch`` (the vectorised backend; the CUDA kernel plans
exact balance only).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any, Protocol

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
from moonplan.plan.plan_type import Plan, Predicted, make_plan
from moonplan.plan.reference import reference_plan, to_tensors
from moonplan.plan.static import static_alloc
from moonplan.plan.torch_backend import plan_torch

EPS = ("0.25", "0.1", "0.05")
"""The ``eps`` of the ``bounded-<eps>`` candidates of ``auto`` (exact decimals)."""

CANDIDATES = ("static", "resident", *(bounded_name(e) for e in EPS), "exact")
"""Candidate names of ``policy="auto"`` in evaluation and tie-break order."""


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
    """``policy="auto"``: the candidate with the least predicted step time (module docstring)."""
    load = _static_load(inp)
    static = build("static", inp)
    best, best_s = static, float(cost.plan_time(static, planned=0).total_s)
    times = {"static": best_s}
    cands: list[tuple[str, list[int] | None, int | None]] = []
    if inp.prev_RB is not None:
        cands.append(("resident", None, None))
    seen = [load]  # targets already planned (the static loads: nothing to plan)
    for e in eps:
        bounded, cap = bounded_targets(load, Fraction(e))
        if bounded not in seen:  # the same targets give the same plan: plan it once
            seen.append(bounded)
            cands.append((bounded_name(e), bounded, cap))
    if targets_list(sum(load), len(load)) not in seen:
        cands.append(("exact", None, None))
    runs = 0
    floor_s: float | None = None  # lower bound of a balancing candidate, without planning
    for name, target, bound in cands:
        if name == "resident":
            cand = build(name, inp)
            if torch.equal(cand.alloc, static.alloc):
                continue  # no resident helps: it is the static plan
        else:
            if floor_s is None:
                floor_s = lower_bound(cost, inp.counts_RE, 0)
            if floor_s + (runs + 1) * cost.plan_s >= best_s:
                continue  # cannot beat the best so far, even perfectly balanced
            runs += 1
            cand = _construct(inp, target, bound, name)
        t = float(cost.plan_time(cand, planned=runs).total_s)
        times[name] = t
        if t < best_s:
            best, best_s = cand, t
    return dataclasses.replace(best, predicted=Predicted(times), planned=runs)


def lower_bound(cost: CostModel, counts_RE: torch.Tensor, planned: int) -> float:
    """A lower bound of any balancing candidate's predicted time, built with ``planned`` runs.

    The step of two imagined ranks, free of traffic (every row computed where it
    was routed, nothing fetched): rank 0 runs ``k = ceil(A/R)`` experts of one
    row each (``A`` experts with records: some rank of any plan runs at least
    ``k``, each padded to a tile and read once), rank 1 runs ``floor(N/R)``
    rows of one expert (some rank of any balanced plan runs at least that).
    A ``StepCost`` grows with rows, experts and traffic, so every candidate's
    time is at least this one's. Only the ``k`` imagined experts are passed
    (which experts they are does not matter: nothing is fetched), so the
    bound costs little next to scoring a plan.
    """
    R = counts_RE.shape[0]
    dev = counts_RE.device
    T_E = counts_RE.sum(0)
    k = -(-int((T_E > 0).sum()) // R)
    rows_KR = torch.zeros(max(k, 1), R, dtype=torch.int64, device=dev)  # imagined experts
    rows_KR[:k, 0] = 1
    if R > 1:
        rows_KR[0, 1] = int(T_E.sum()) // R
    sent_RK = rows_KR.t().contiguous()  # every row stays on the rank that routed it
    fetch_KR = torch.zeros(rows_KR.shape, dtype=torch.bool, device=dev)
    src_K = torch.zeros(rows_KR.shape[0], dtype=torch.int64, device=dev)
    return float(cost.step_time(rows_KR, sent_RK, fetch_KR, src_K, planned=planned).total_s)


def _static_load(inp: Inputs) -> list[int]:
    R, E = inp.counts_RE.shape
    load_R = torch.zeros(R, dtype=torch.int64, device=inp.counts_RE.device)
    return load_R.index_add_(0, home_map(E, R, device=load_R.device), inp.counts_RE.sum(0)).tolist()


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
