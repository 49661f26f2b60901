"""The plan a refill leaves serving: static EP's records over a given slot table.

Legend:
    R ranks    E experts    B slots per rank
    slot_RB    int64 ``[R, B]`` the expert in each slot (``-1``: empty)

A refill copies experts into slots beside the steps; once every copy has arrived, the
next step plans with ``previous=`` a plan whose slots are the refilled ones. Only the
slots (and the flows, none here) of ``previous`` are read, so the serving plan is static
EP's allocation laid out over those slots: nothing is new, nothing is direct.
"""

from __future__ import annotations

import torch

from moonplan.errors import PlanError
from moonplan.plan.from_alloc import layout_resident
from moonplan.plan.home import home_map
from moonplan.plan.placement import static_alloc
from moonplan.plan.plan_type import Plan, make_plan


def serving_plan(counts_RE: torch.Tensor, slot_RB: torch.Tensor, *, align: int = 1) -> Plan:
    """A valid plan of ``counts_RE`` (int64 ``[R, E]``) whose slots are ``slot_RB``.

    Raises:
        PlanError: ``slot_RB`` is not ``[R, B]``, names an expert out of range, holds an
            expert twice on one rank or a rank's own home expert.
    """
    R, E = counts_RE.shape
    slot_RB = slot_RB.to(device=counts_RE.device, dtype=torch.int64)
    check_slots(slot_RB, R, E)
    alloc_ER = static_alloc(counts_RE)
    fields = layout_resident(alloc_ER, slot_RB.shape[1], align, slot_RB)
    return make_plan(fields, counts=counts_RE, num_slots=slot_RB.shape[1], align=align,
                     backend="torch", policy="static", planned=0)  # fmt: skip


def check_slots(slot_RB: torch.Tensor, R: int, E: int) -> None:
    """A slot table's invariants (invariant 4 of ``docs/design.md``), or ``PlanError``."""
    if slot_RB.dim() != 2 or slot_RB.shape[0] != R:
        raise PlanError(f"slots must be [R={R}, B], got {tuple(slot_RB.shape)}")
    rows = slot_RB.cpu().tolist()
    home = home_map(E, R).tolist()
    for r, row in enumerate(rows):
        held = [e for e in row if e != -1]
        if any(not 0 <= e < E for e in held):
            raise PlanError(f"rank {r}'s slots {row} name an expert outside 0..{E - 1}")
        if len(set(held)) != len(held):
            raise PlanError(f"rank {r}'s slots {row} hold an expert twice")
        if any(home[e] == r for e in held):
            raise PlanError(f"rank {r}'s slots {row} hold one of its own home experts")
