"""``moonplan.plan``: validate input, pick a backend, build a :class:`Plan`.

Legend: R ranks, E experts, B slots.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.errors import PlanError
from moonplan.plan.home import max_local
from moonplan.plan.plan_type import Plan
from moonplan.plan.reference import reference_plan, to_tensors
from moonplan.plan.validate import as_counts, check_options

BACKENDS = ("auto", "reference")


def plan(
    counts: Any,
    *,
    slots: int | None = None,
    align: int = 1,
    previous: Plan | None = None,
    backend: str = "auto",
    num_ranks: int | None = None,
) -> Plan:
    """Plan which rank executes how many records of each expert, exactly balanced.

    Args:
        counts: ``[R, E]`` non-negative integers (tensor, numpy array or lists):
            records that source rank ``s`` routes to expert ``e`` (the all-gathered
            router counts). The plan's tensors live on its device.
        slots: prefetch slots per rank ``B`` (default ``M = ceil(E/R)``: every
            replica is prefetched). Replicas beyond ``B`` are marked direct.
        align: pad every row of the receive buffer to a multiple of ``align``.
        previous: the last plan whose slots still hold valid weights; resident
            replicas are preferred and kept, so fewer weights move.
        backend: ``"auto"`` or ``"reference"``.
        num_ranks: if given, ``counts`` must have this many rows.

    Returns:
        An immutable :class:`Plan` meeting the invariants of DESIGN §3.

    Raises:
        PlanError: bad counts, options, or a ``previous`` plan of another shape.
    """
    counts_RE = as_counts(counts, num_ranks)
    R, E = counts_RE.shape
    B = check_options(slots, align, max_local(E, R))
    prev_slots = _previous_slots(previous, R, E, B)
    if backend not in BACKENDS:
        raise PlanError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    res = reference_plan(counts_RE.tolist(), B, align, prev_slots)
    return Plan(
        counts=counts_RE,
        num_slots=B,
        align=align,
        backend="reference",
        **to_tensors(res, counts_RE.device),
    )


def _previous_slots(previous: Plan | None, R: int, E: int, B: int) -> list[list[int]] | None:
    if previous is None:
        return None
    if not isinstance(previous, Plan):
        raise PlanError(f"previous must be a moonplan Plan, got {type(previous).__name__}")
    if (previous.num_ranks, previous.num_experts, previous.num_slots) != (R, E, B):
        raise PlanError(
            "previous plan has (R, E, B) = "
            f"{(previous.num_ranks, previous.num_experts, previous.num_slots)}, "
            f"this call has {(R, E, B)}"
        )
    slots: list[list[int]] = previous.slot_expert.tolist()
    return slots
