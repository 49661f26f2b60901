"""``policy="auto"``: one planner call scores every candidate and keeps the fastest.

Legend: R ranks, E experts, B slots, K levels, C = K + 4 candidates.

The candidates (:mod:`~moonplan.plan.choice.table`): static EP, the exact plan restricted
to resident replicas, ``K - 1`` levels of capped water-filling between exact balance and
static EP (:mod:`~moonplan.plan.choice.targets`), exact balance, MoonEP's greedy
allocation, and static EP over the slots (``placed``: whole experts moved into them). Each
is scored by the step-cost formula (``moonplan.stepcost``) and the least predicted time
wins, ties to the earlier entry; static EP is one of them, so the chosen plan is never
predicted slower than static EP. An early exit (:mod:`~moonplan.plan.choice.bound`)
returns static EP, or where replicas are resident ``placed`` or the ``resident``
candidate (built only where it could beat the other two by its build), without building
anything else when no plan that copies can beat it, or while a full call could not yet
have paid for itself (``rent.exit_rent``).

The rule is a pure function of the all-gathered counts, ``previous`` and the cost model,
so every rank chooses alike. Four forms give the same plan and scores bit for bit:
``reference.py`` (plain Python, the definition), ``host.py`` (CPU tensors), ``tensor.py``
(torch ops on any device, no host read) and the CUDA kernel (``moonplan.plan.choice_cuda``,
``csrc/choice_kernel.cu``: three launches, no host read).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from moonplan.errors import PlanError
from moonplan.plan.choice import host, reference, tensor
from moonplan.plan.choice.cost_options import check_cost
from moonplan.plan.choice.table import LEVELS, Candidate, names, table
from moonplan.plan.choice.targets import bounded_cap, parse_bounded, water_fill
from moonplan.plan.plan_fields import PlanFields
from moonplan.plan.plan_type import Choice, Plan, make_plan, plan_to
from moonplan.plan.reference import previous_flows
from moonplan.stepcost.step_cost import StepCost

PATHS = ("reference", "host", "tensor", "cuda")
"""Forms of the choice: plain Python, host integers (CPU), torch ops (any device), the fused
CUDA kernel (``moonplan.plan.choice_cuda``, CUDA tensors)."""


def choose(
    counts_RE: torch.Tensor,
    num_slots: int,
    align: int,
    previous: Plan | None,
    cost: StepCost,
    path: str,
    levels: int = LEVELS,
    *,
    rent: bool = True,
) -> Plan:
    """The ``auto`` plan of validated inputs (int64 ``counts_RE [R, E]`` on its device).

    ``rent=False``: the rent-or-buy rule buys nothing for later steps (the forms run with
    a credit of ``-inf``: no buy is ever due, the exit rests on its bound alone) and the
    plan carries a credit of 0.

    ``path``: one of :data:`PATHS` (``host`` needs CPU tensors; ``reference`` plans on
    the host and copies the plan to the counts' device; ``tensor`` reads nothing on the
    host; ``cuda`` needs CUDA tensors and reads nothing on the host either).

    Raises:
        PlanError: ``cost`` has an option no form models (``cost_options.check_cost``:
            a dispatch scheme other than ``"record"``), on every path alike.
    """
    check_cost(cost)
    sizes = (num_slots, align)
    if path in ("tensor", "cuda"):
        prev = _prev(previous, counts_RE.device)
        carried = _carried(previous, counts_RE.device, rent)
        if path == "cuda":
            from moonplan.plan.choice_cuda import choose_cuda

            fields, made = choose_cuda(counts_RE, num_slots, align, prev, cost, levels, carried)
        else:
            fields, made = tensor.choose_tensor(
                counts_RE, num_slots, align, prev, cost, levels, carried
            )
        backend = "cuda" if path == "cuda" else "torch"
        if not rent:
            made = (*made[:3], torch.zeros_like(made[3]), *made[4:])
        return _make(counts_RE, fields, sizes, backend, Choice(names(levels), *made))
    c = counts_RE.cpu()
    prev = _prev(previous, torch.device("cpu"))
    credit, pending = (float(x) for x in _carried(previous, torch.device("cpu"), rent))
    if path == "reference":
        step = _step(c, num_slots, align, prev, credit, pending)
        got = reference.choose_reference(step, cost, levels)
        kept = (got.credit if rent else 0.0, got.pending)
        choice = _choice(got.index, got.scores, got.exited, kept, levels, got.rounds)
        p = _make(c, got.fields, sizes, "reference", choice)
    elif path == "host":
        fields, (index, scores, exited, after, owed, rounds) = host.choose_host(
            c, num_slots, align, prev, cost, levels, (credit, pending)
        )
        carry = (after if rent else 0.0, owed)
        p = _make(c, fields, sizes, "torch", _choice(index, scores, exited, carry, levels, rounds))
    else:
        raise PlanError(f"unknown path {path!r}; choose one of {PATHS}")
    return plan_to(p, counts_RE.device)


def is_named(name: str) -> bool:
    """Whether ``name`` is a candidate that ``policy=name`` builds on its own."""
    return name in names() or parse_bounded(name) is not None


def build_named(
    name: str,
    counts_RE: torch.Tensor,
    num_slots: int,
    align: int,
    previous: Plan | None,
    reference_backend: bool,
    cost: StepCost | None = None,
) -> Plan:
    """The plan of one named candidate (``"resident"``, ``"greedy"``, ``"placed"``,
    ``"level-<k>"``, ``"bounded-<eps>"``; ``"static"`` and ``"exact"`` have their own
    paths), built on a host copy (reference or host integers) and returned on the counts'
    device (``cost``: what picks ``"resident"``'s rounding, records without one)."""
    c = counts_RE.cpu()
    prev = _prev(previous, torch.device("cpu"))
    hs = host.HostStep.of(c, num_slots, align, prev)
    eps = parse_bounded(name)
    bound = None
    if eps is not None:
        bound = bounded_cap(sum(hs.load), len(hs.load), eps)
        flows, alloc = host.construct(hs, water_fill(hs.load, bound), replay=True)
    elif reference_backend:
        step = _step(c, num_slots, align, prev)
        got, flows = reference.build(_candidate(name), step, LEVELS, cost)
        alloc = np.array(got, dtype=np.int64).reshape(c.shape[1], c.shape[0])
    else:
        alloc, flows = host.build(_candidate(name), hs, LEVELS, cost)
    backend = "reference" if reference_backend else "torch"
    p = make_plan(host.layout(hs, alloc, flows), counts=c, num_slots=num_slots, align=align,
                  backend=backend, policy=name, planned=int(name != "resident"),
                  declared_bound=bound)  # fmt: skip
    return plan_to(p, counts_RE.device)


def _candidate(name: str) -> Candidate:
    for cand in table():
        if cand.name == name:
            return cand
    raise PlanError(f"unknown candidate {name!r}; the candidates are {names()}")


def _prev(
    previous: Plan | None, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``previous``'s slots and flows on ``device`` (``(None, None)`` without one)."""
    if previous is None:
        return None, None
    return previous.slot_expert.to(device), previous.flow.to(device)


def _carried(
    previous: Plan | None, device: torch.device, rent: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 0-d ``(credit, pending)`` of ``previous`` (``rent.exit_rent``): its
    rent-or-buy credit (``-inf`` without ``rent``: no buy for later steps is ever due) and
    what a full call could have saved since the last one; 0 without an ``auto`` plan."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    if previous is None or previous.choice is None:
        credit, pending = zero, zero
    else:
        credit, pending = (x.to(device) for x in (previous.choice.credit, previous.choice.pending))
    if not rent:
        credit = torch.full((), -math.inf, dtype=torch.float64, device=device)
    return credit, pending


def _step(
    counts: torch.Tensor,
    num_slots: int,
    align: int,
    prev: tuple[torch.Tensor | None, torch.Tensor | None],
    credit: float = 0.0,
    pending: float = 0.0,
) -> reference.Step:
    slots = None if prev[0] is None else prev[0].tolist()
    flows = previous_flows(prev[1])
    return reference.Step(counts.tolist(), num_slots, align, slots, flows, credit, pending)


def _choice(
    index: int,
    scores: list[float] | torch.Tensor,
    exited: bool,
    carry: tuple[float, float],
    levels: int,
    rounds: int,
) -> Choice:
    """A :class:`Choice` of host values (CPU tensors); ``carry``: ``(credit, pending)``."""
    return Choice(
        names(levels),
        torch.tensor(index, dtype=torch.int64),
        torch.as_tensor(scores, dtype=torch.float64),
        torch.tensor(exited),
        torch.tensor(carry[0], dtype=torch.float64),
        torch.tensor(carry[1], dtype=torch.float64),
        torch.tensor(rounds, dtype=torch.int64),
    )


def _make(
    counts_RE: torch.Tensor,
    fields: PlanFields,
    sizes: tuple[int, int],
    backend: str,
    choice: Choice,
) -> Plan:
    num_slots, align = sizes
    return make_plan(fields, counts=counts_RE, num_slots=num_slots, align=align,
                     backend=backend, policy="auto", planned=1, choice=choice)  # fmt: skip
