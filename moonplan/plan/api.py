"""``moonplan.plan``: validate input, pick a policy and a backend, build a :class:`Plan`.

Legend: R ranks, E experts, B slots.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.errors import PlanError
from moonplan.plan.choice import build_named, choose, is_named
from moonplan.plan.from_alloc import layout_reference
from moonplan.plan.home import max_local
from moonplan.plan.placement import static_alloc
from moonplan.plan.plan_type import Plan, make_plan, previous_slots
from moonplan.plan.reference import reference_fields
from moonplan.plan.static import static_checked
from moonplan.plan.torch_backend import plan_torch
from moonplan.plan.validate import check_options, checked_counts
from moonplan.stepcost.step_cost import StepCost

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
    cost: StepCost | None = None,
    rent: bool = True,
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
            any device), ``"cuda"`` (the fused kernel) or ``"auto"`` (``"cuda"`` on a
            CUDA device where the kernel is available, else ``"torch"``).
        num_ranks: if given, ``counts`` must have this many rows.
        check_input: read ``counts`` on the host to reject negative entries. Turn it
            off only to capture the plan in a CUDA graph, with counts known to be valid.
        policy: ``"exact"`` (exact balance; bit-identical on every backend),
            ``"static"`` (static EP, no replicas), ``"auto"`` (the candidate with the
            least step time predicted by ``cost``, chosen in the same call: one fused
            kernel call on the ``cuda`` backend; ``docs/planner-policy.md``) or one
            candidate by name: ``"resident"``
            (balance through the replicas resident in ``previous``'s slots, no copy),
            ``"greedy"`` (MoonEP's greedy allocation), ``"level-<k>"`` (``1 <= k < 8``)
            or ``"bounded-<eps>"`` (every load at most ``ceil(N/R * (1 + eps))``).
            Named candidates are built on a host copy of the counts.
        cost: the :class:`~moonplan.stepcost.StepCost` ``policy="auto"`` needs. With
            ``policy="resident"`` it is optional: it picks the faster rounding, whole
            records or whole GEMM tiles of its ``tile_rows`` (records without it).
        rent: ``policy="auto"`` buys copies that pay over later steps (rent or buy, the
            credit carried in ``previous``). ``False``: each step buys only what pays in
            that step, and carries no credit (for a caller that places the slots for later
            steps itself, as ``balance="auto"``'s background refill does).

    Returns:
        An immutable :class:`Plan` meeting the invariants of ``docs/design.md`` §3
        (exact balance for ``policy="exact"``, its ``load_bound`` otherwise).

    Raises:
        PlanError: bad counts, options, policy, a missing or wrong ``cost`` for
            ``"auto"``, or a ``previous`` plan of another shape.
    """
    if backend not in BACKENDS:
        raise PlanError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    _check_policy(policy, cost)
    counts_RE, N = checked_counts(counts, num_ranks, check_values=check_input)
    R, E = counts_RE.shape
    B = check_options(slots, align, max_local(E, R), counts_RE, check_values=check_input, total=N)
    prev_RB = previous_slots(previous, R, E, B, counts_RE.device)
    if policy == "static" and backend != "reference":
        return static_checked(counts_RE, B, align, prev_RB)
    name = _resolve(backend, counts_RE.device)
    if policy == "auto":
        assert isinstance(cost, StepCost)  # _check_policy
        path = _path(name, counts_RE.device)
        return choose(counts_RE, B, align, previous, cost, path, rent=rent)
    if policy == "static":  # the reference backend
        fields = layout_reference(counts_RE, static_alloc(counts_RE), B, align, prev_RB)
        return make_plan(fields, counts=counts_RE, num_slots=B, align=align,
                         backend=name, policy="static", planned=0)  # fmt: skip
    if policy != "exact":
        return build_named(policy, counts_RE, B, align, previous, name == "reference", cost)
    prev_F3 = None if previous is None else previous.flow.to(counts_RE.device)
    if name == "reference":
        fields = reference_fields(counts_RE, B, align, (prev_RB, prev_F3), device=counts_RE.device)
    elif name == "torch":
        fields = plan_torch(counts_RE, B, align, prev_RB, prev_F3)
    else:
        from moonplan.plan.cuda_backend import plan_cuda

        fields = plan_cuda(counts_RE, B, align, prev_RB, prev_F3)
    return make_plan(fields, counts=counts_RE, num_slots=B, align=align, backend=name)


POLICIES = ("exact", "static", "auto", "resident", "greedy", "level-<k>", "bounded-<eps>")
"""The ``policy=`` names :func:`plan` accepts (``<k>``: 1 to 7; ``<eps>``: a decimal >= 0)."""


def _check_policy(policy: object, cost: object) -> None:
    """PlanError unless ``policy`` is one of :data:`POLICIES` (exactly: no spaces, no case
    folding), ``"auto"`` has a ``StepCost`` and any other ``cost`` is one or ``None``."""
    if not isinstance(policy, str):
        raise PlanError(f"policy must be a string, got {policy!r}")
    if policy not in ("exact", "static", "auto") and not is_named(policy):
        raise PlanError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if policy == "auto" and not isinstance(cost, StepCost):
        got = "no cost" if cost is None else f"cost={type(cost).__name__}"
        raise PlanError(
            f"policy='auto' needs cost=StepCost(...) to predict step times, got {got} (e.g. "
            "moonplan.stepcost.StepCost.from_hardware('h200-node', 'deepseek-v3'))"
        )
    if cost is not None and not isinstance(cost, StepCost):
        raise PlanError(f"cost must be a StepCost or None, got {type(cost).__name__}")


def _path(backend: str, device: torch.device) -> str:
    """Which form of the choice runs (``moonplan.plan.choice.PATHS``): the fused kernel for
    the ``cuda`` backend, the host form on CPU tensors, torch ops elsewhere."""
    if backend in ("reference", "cuda"):
        return backend
    return "host" if device.type == "cpu" else "tensor"


def _resolve(backend: str, device: torch.device) -> str:
    """The concrete backend for ``backend`` on ``device`` (``auto`` picks the fastest)."""
    if backend != "auto":
        return backend
    if device.type == "cuda":
        from moonplan.plan.cuda_backend import available

        if available()[0]:
            return "cuda"
    return "torch"
