"""Static EP as a :class:`Plan`: every record runs on its expert's home rank (no balancing).

Legend: R ranks, E experts, B slots, M = ceil(E/R).

It is the baseline the runtime is measured against ("planning off") and the
cheapest candidate of ``policy="auto"``: the same dispatch, experts and
combine, with the loads the router happens to produce. Its ``target`` is the
static load, so it does not meet invariant 2; it declares that load's maximum
as its ``load_bound``. The allocation itself comes from
:func:`moonplan.plan.placement.static_alloc`, the one place static placement is computed.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.plan.from_alloc import layout_resident
from moonplan.plan.home import max_local
from moonplan.plan.placement import static_alloc
from moonplan.plan.plan_type import Plan, make_plan, previous_slots
from moonplan.plan.validate import check_options, checked_counts


def static_plan(
    counts: Any,
    *,
    slots: int | None = None,
    align: int = 1,
    previous: Plan | None = None,
    check_input: bool = True,
) -> Plan:
    """The static-EP plan of ``counts [R, E]`` (same tensor shapes as :func:`moonplan.plan`).

    With ``previous=`` the slots keep ``previous``'s residents (nothing moves), so a
    later balanced step still finds them. With ``check_input=False`` no value is
    read on the host (``load_bound`` is read lazily).
    """
    counts_RE, N = checked_counts(counts, check_values=check_input)
    R, E = counts_RE.shape
    B = check_options(slots, align, max_local(E, R), counts_RE, check_values=check_input, total=N)
    return static_checked(counts_RE, B, align, previous_slots(previous, R, E, B, counts_RE.device))


def static_checked(
    counts_RE: torch.Tensor, num_slots: int, align: int, prev_RB: torch.Tensor | None
) -> Plan:
    """:func:`static_plan` of inputs already validated (as :func:`moonplan.plan` does):
    int64 ``counts_RE [R, E]``, ``num_slots`` B, ``align`` and ``previous``'s slots
    ``prev_RB [R, B]`` on the counts' device (or ``None``). Reads nothing on the host."""
    B = num_slots
    fields = layout_resident(static_alloc(counts_RE), B, align, prev_RB)
    return make_plan(
        fields,
        counts=counts_RE,
        num_slots=B,
        align=align,
        backend="static",
        policy="static",
        planned=0,
    )
