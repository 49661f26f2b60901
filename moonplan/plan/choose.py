"""``policy=`` of :func:`moonplan.plan`: build one named candidate, or choose among them (``auto``).

Legend:
    R ranks, E experts, B slots, N records in all
    counts_RE   int64 [R, E] validated router counts
    prev_RB     int64 [R, B] previous plan's slots (or None), prev_F3 its flows

Candidates, in the fixed order they are evaluated and ties are broken (the
cheapest plan first, so it wins a tie):

``static``, ``resident`` (only with ``previous=``), ``bounded-<eps>`` for
``eps`` in :data:`EPS` (largest first; skipped when no rank is above its cap,
where it would be the static plan), ``exact``.

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
from moonplan.plan.from_alloc import layout_reference, layout_torch
from moonplan.plan.home import home_map
from moonplan.plan.plan_type import Plan, Predicted, make_plan
from moonplan.plan.reference import reference_plan, to_tensors
from moonplan.plan.static import static_alloc
from moonplan.plan.torch_backend import plan_torch

EPS = ("0.25", "0.1", "0.05")
"""The ``eps`` of the ``bounded-<eps>`` candidates of ``auto`` (exact decimals)."""

CANDIDATES = ("static", "resident", *(bounded_name(e) for e in EPS), "exact")
"""Candidate names of ``policy="auto"`` in evaluation and tie-break order."""


class CostModel(Protocol):
    """What ``policy="auto"`` needs of a cost model (``moonplan.stepcost.StepCost`` has it)."""

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
    best: Plan | None = None
    best_s = float("inf")
    times: dict[str, float] = {}
    runs = 0
    load = _static_load(inp)
    for name in ("static", "resident", *(bounded_name(e) for e in eps), "exact"):
        if name == "resident" and inp.prev_RB is None:
            continue
        balancing = name not in ("static", "resident")
        if balancing:
            e = parse_bounded(name)
            if e is not None and bounded_targets(load, e)[0] == load:
                continue  # no rank above the cap: the static plan, planned for nothing
            if best is not None and lower_bound(cost, inp.counts_RE, runs + 1) >= best_s:
                continue
            runs += 1
        cand = build(name, inp)
        t = float(cost.plan_time(cand, planned=runs).total_s)
        times[name] = t
        if t < best_s:
            best, best_s = cand, t
    assert best is not None  # static is always evaluated
    return dataclasses.replace(best, predicted=Predicted(times), planned=runs)


def lower_bound(cost: CostModel, counts_RE: torch.Tensor, planned: int) -> float:
    """A lower bound of any balancing candidate's predicted time, built with ``planned`` runs.

    Perfectly balanced and free of traffic: every rank computes ``floor(N/R)``
    rows of a single expert whose weights are already there, and every row stays
    on the rank that routed it (nothing crosses a link, nothing is fetched).
    A real candidate has at least that many rows on its busiest rank, at least
    one expert there, and sends at least as much, so under a cost model that
    grows with rows, experts and traffic its time is at least this.
    """
    R, E = counts_RE.shape
    dev = counts_RE.device
    share = int(counts_RE.sum()) // R
    e_R = torch.arange(R, device=dev) % E
    r_R = torch.arange(R, device=dev)
    rows_ER = torch.zeros(E, R, dtype=torch.int64, device=dev)
    rows_ER[e_R, r_R] = share
    sent_RE = torch.zeros(R, E, dtype=torch.int64, device=dev)
    sent_RE.index_put_((r_R, e_R), torch.full((R,), share, device=dev), accumulate=True)
    fetch_ER = torch.zeros(E, R, dtype=torch.bool, device=dev)
    t = cost.step_time(rows_ER, sent_RE, fetch_ER, home_map(E, R, device=dev), planned=planned)
    return float(t.total_s)


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
    """A plan executing ``alloc_ER`` (at most ``M`` remote experts per rank by construction)."""
    if inp.backend == "reference":
        fields = layout_reference(inp.counts_RE, alloc_ER, inp.num_slots, inp.align, inp.prev_RB)
    else:
        fields = layout_torch(alloc_ER, inp.num_slots, inp.align, inp.prev_RB)
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
