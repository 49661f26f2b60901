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
from moonplan.plan.torch_backend import plan_torch
from moonplan.plan.validate import as_counts, check_options

BACKENDS = ("auto", "reference", "torch", "cuda")


def plan(
    counts: Any,
    *,
    slots: int | None = None,
    align: int = 1,
    previous: Plan | None = None,
    backend: str = "auto",
    num_ranks: int | None = None,
    check_input: bool = True,
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
        backend: ``"reference"`` (plain Python, the spec), ``"torch"`` (vectorised,
            any device, no host sync), ``"cuda"`` (the fused kernel) or ``"auto"``
            (``"cuda"`` on a CUDA device where the kernel is available, else ``"torch"``).
        num_ranks: if given, ``counts`` must have this many rows.
        check_input: read ``counts`` on the host to reject negative entries. Turn it
            off only to capture the plan in a CUDA graph, with counts known to be valid.

    Returns:
        An immutable :class:`Plan` meeting the invariants of ``moonplan/plan/README.md``.

    Raises:
        PlanError: bad counts, options, or a ``previous`` plan of another shape.
    """
    if backend not in BACKENDS:
        raise PlanError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    counts_RE = as_counts(counts, num_ranks, check_values=check_input)
    R, E = counts_RE.shape
    B = check_options(slots, align, max_local(E, R), counts_RE, check_values=check_input)
    prev_RB = _previous_slots(previous, R, E, B, counts_RE.device)
    name = _resolve(backend, counts_RE.device)
    prev_F3 = None if previous is None else previous.flow.to(counts_RE.device)
    if name == "reference":
        prev_slots = None if prev_RB is None else prev_RB.tolist()
        prev_flows = None if prev_F3 is None else [tuple(f) for f in prev_F3.tolist() if f[0] >= 0]
        res = reference_plan(counts_RE.tolist(), B, align, prev_slots, prev_flows)
        fields = to_tensors(res, counts_RE.device)
    elif name == "torch":
        fields = plan_torch(counts_RE, B, align, prev_RB, prev_F3)
    else:
        from moonplan.plan.cuda_backend import plan_cuda

        fields = plan_cuda(counts_RE, B, align, prev_RB, prev_F3)
    return Plan(counts=counts_RE, num_slots=B, align=align, backend=name, **fields)


def _resolve(backend: str, device: torch.device) -> str:
    """The concrete backend for ``backend`` on ``device`` (``auto`` picks the fastest)."""
    if backend != "auto":
        return backend
    if device.type == "cuda":
        from moonplan.plan.cuda_backend import available

        if available()[0]:
            return "cuda"
    return "torch"


def _previous_slots(
    previous: Plan | None, R: int, E: int, B: int, device: torch.device
) -> torch.Tensor | None:
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
    return previous.slot_expert.to(device)
