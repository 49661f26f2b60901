"""``moonplan.plan``: validate input, pick a policy and a backend, build a :class:`Plan`.

Legend: R ranks, E experts, B slots.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.errors import PlanError
from moonplan.plan.choose import CostModel, Inputs, build, choose
from moonplan.plan.home import max_local
from moonplan.plan.plan_type import Plan, make_plan, plan_to, previous_slots
from moonplan.plan.reference import reference_fields
from moonplan.plan.static import static_checked
from moonplan.plan.torch_backend import plan_torch
from moonplan.plan.validate import check_options, checked_counts

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
    policy: str = "exact",
    cost: CostModel | None = None,
) -> Plan:
    """Plan which rank executes how many records of each expert (exactly balanced by default).

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
        policy: ``"exact"`` (exact balance; bit-identical on every backend),
            ``"static"`` (no replicas), ``"resident"`` (only replicas resident in
            ``previous``'s slots), ``"greedy"`` (the MoonEP greedy's allocation,
            residents reused), ``"bounded-<eps>"`` (every load at most
            ``ceil(N/R * (1 + eps))``, fewer copies) or ``"auto"`` (the candidate
            with the least step time predicted by ``cost``; see
            ``docs/planner-policy.md``). Policies other than ``exact`` and
            ``static`` read the counts on the host and run the ``torch`` builder
            (``reference`` with ``backend="reference"``).
        cost: the cost model ``policy="auto"`` needs (a ``moonplan.stepcost.StepCost``,
            or any object with its ``plan_time`` and ``step_time``).

    Returns:
        An immutable :class:`Plan` meeting the invariants of ``docs/design.md`` §3
        (exact balance for ``policy="exact"``, its ``load_bound`` otherwise).

    Raises:
        PlanError: bad counts, options, policy, a missing ``cost`` for ``"auto"``,
            or a ``previous`` plan of another shape.
    """
    if backend not in BACKENDS:
        raise PlanError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if not isinstance(policy, str):
        raise PlanError(f"policy must be a string, got {policy!r}")
    if policy == "auto" and cost is None:
        raise PlanError(
            "policy='auto' needs cost=StepCost(...) (e.g. "
            "moonplan.stepcost.StepCost.from_hardware('h200-node', model)) to predict step times"
        )
    if policy != "exact" and backend == "cuda":
        raise PlanError(
            f"the cuda backend plans exact balance only; policy={policy!r} needs backend "
            "'auto', 'torch' or 'reference' (the torch builder runs on any device)"
        )
    counts_RE, N = checked_counts(counts, num_ranks, check_values=check_input)
    R, E = counts_RE.shape
    B = check_options(slots, align, max_local(E, R), counts_RE, check_values=check_input, total=N)
    prev_RB = previous_slots(previous, R, E, B, counts_RE.device)
    if policy == "static" and backend != "reference":
        return static_checked(counts_RE, B, align, prev_RB)
    name = _resolve(backend, counts_RE.device)
    prev_F3 = None if previous is None else previous.flow.to(counts_RE.device)
    if policy != "exact":
        return _policy_plan(policy, counts_RE, B, align, previous, name, cost)
    if name == "reference":
        fields = reference_fields(counts_RE, B, align, (prev_RB, prev_F3), device=counts_RE.device)
    elif name == "torch":
        fields = plan_torch(counts_RE, B, align, prev_RB, prev_F3)
    else:
        from moonplan.plan.cuda_backend import plan_cuda

        fields = plan_cuda(counts_RE, B, align, prev_RB, prev_F3)
    return make_plan(fields, counts=counts_RE, num_slots=B, align=align, backend=name)


def _policy_plan(
    policy: str,
    counts_RE: torch.Tensor,
    B: int,
    align: int,
    previous: Plan | None,
    name: str,
    cost: CostModel | None,
) -> Plan:
    """A policy other than ``exact`` (``static`` on the reference backend included),
    built on the host and handed back on the counts' device.

    Its builders take many small steps and read the counts on the host; on an
    accelerator each step is a kernel launch and each read a synchronisation, which
    made them 2-50x slower there than on host copies (``bench/bench_plan_paths.py``,
    ``docs/benchmarks.md``), so an accelerator's counts are planned on a host copy and
    the plan's tensors are copied back (:func:`~moonplan.plan.plan_type.plan_to`)."""
    device, host = counts_RE.device, torch.device("cpu")
    counts_RE = counts_RE.to(host)
    prev_RB = None if previous is None else previous.slot_expert.to(host)
    prev_F3 = None if previous is None else previous.flow.to(host)
    builder = "reference" if name == "reference" else "torch"
    prev_policy = None if previous is None else previous.policy
    prev_basis = None if previous is None else previous.basis
    inp = Inputs(counts_RE, B, align, prev_RB, prev_F3, builder, prev_policy, prev_basis)
    p = choose(inp, cost) if policy == "auto" and cost is not None else build(policy, inp)
    return plan_to(p, device)


def _resolve(backend: str, device: torch.device) -> str:
    """The concrete backend for ``backend`` on ``device`` (``auto`` picks the fastest)."""
    if backend != "auto":
        return backend
    if device.type == "cuda":
        from moonplan.plan.cuda_backend import available

        if available()[0]:
            return "cuda"
    return "torch"
