"""Choosing ahead: ``policy="auto"``'s choice made off the critical path, one step early.

Legend: R ranks, E experts, ``counts_RE`` int64 ``[R, E]`` one step's all-gathered
router counts.

``moonplan.plan(counts, policy="auto", cost=...)`` chooses *inline*: the search
(screens, scores, the candidates it builds) runs between the counts' all-gather and
the dispatch, on every step's critical path. Choosing ahead moves the search off it:

* after step ``t`` the choice runs on what step ``t`` saw, ``choose_next(counts_t,
  plan_{t-1})`` (the same search ``policy="auto"`` would have run at step ``t``),
  beside the rest of the model (a host thread in the runtime);
* step ``t + 1`` builds only the candidate that choice named, on its own counts:
  ``moonplan.plan(counts_{t+1}, previous=plan_t, policy=name)`` (one construction
  for a balancing candidate, none for ``static`` or ``resident``).

The forecast is the last step: its counts and the slots it started from, so a
candidate's fetch is judged on one real step-to-step change (with ``previous =
plan_t`` and ``counts_t`` the balancing candidates would replay ``plan_t`` and look
as if they fetched nothing). Steps before the first choice plan inline
(:meth:`AheadChoice.policy` is ``"auto"``).

Keeping the choice (``moonplan.plan.keep``) works as inline: inline ``"auto"``'s
``previous`` carries the :class:`~moonplan.plan.plan_type.Basis` of the last full
choice, while a plan built by name carries none. So :class:`AheadChoice` hands the
search ``plan_{t-1}`` with the basis of the search that named its candidate, and a
search that may keep its choice costs a keep test, not a full choice.

The search is the lean one (``moonplan.plan.search``): the same choice as inline
``"auto"``, by name, with no plan laid out (the next step builds its candidate); a
step that keeps the choice builds nothing (``Choice.planned`` is 0 where inline
``"auto"`` counts the kept candidate's construction).

Every input is all-gathered or derived from all-gathered data, so every rank names
the same candidate, as inline ``"auto"`` does.
"""

from __future__ import annotations

import dataclasses

import torch

from moonplan.errors import PlanError
from moonplan.plan.choose import CostModel, Inputs
from moonplan.plan.home import max_local
from moonplan.plan.plan_type import Basis, Plan
from moonplan.plan.search import Choice, search
from moonplan.plan.validate import check_options, checked_counts


@dataclasses.dataclass(frozen=True)
class Before:
    """What the search reads of the plan it starts from, on the host.

    Attributes:
        slot_expert: int64 ``[R, B]`` its slots (CPU).
        flow: int64 ``[R-1, 3]`` its group flows (CPU).
        policy: its candidate (the search tries it first; a kept choice names it).
        basis: the basis of the search that named it (:attr:`AheadChoice.before`).
        num_experts: ``E`` of its counts.
    """

    slot_expert: torch.Tensor
    flow: torch.Tensor
    policy: str
    basis: Basis | None
    num_experts: int

    @classmethod
    def of(cls, p: Plan) -> Before:
        """Host copies of ``p``'s slots and flows (a device read where ``p`` lives on one)."""
        cpu = torch.device("cpu")
        return cls(p.slot_expert.to(cpu), p.flow.to(cpu), p.policy, p.basis, p.num_experts)


def choose_next(
    counts_RE: object,
    before: Plan | Before | None,
    *,
    cost: CostModel,
    slots: int | None = None,
    align: int = 1,
    backend: str = "torch",
) -> Choice:
    """``policy="auto"``'s choice on step ``t``'s counts from step ``t - 1``'s plan, by name.

    Args:
        counts_RE: step ``t``'s counts ``[R, E]`` (anything ``moonplan.plan`` accepts;
            read on the host).
        before: the plan of step ``t - 1``, or its host copies (:meth:`Before.of`: what a
            background thread is handed), or ``None`` (no resident slots).
        cost, slots, align: as for ``moonplan.plan``.
        backend: ``"reference"`` searches with the reference builder, ``"torch"`` and
            ``"auto"`` with the torch builder (as ``policy="auto"`` does; the two choose
            alike); ``"cuda"`` plans exact balance only and is refused, as there.

    Returns:
        The :class:`~moonplan.plan.search.Choice` of the lean search
        (``moonplan.plan.search``): the same choice inline ``"auto"`` makes at step
        ``t``; its ``policy`` names step ``t + 1``'s candidate and its
        ``planned``/``chose`` are the search's work (off the critical path).

    Raises:
        PlanError: bad counts or options, or ``before`` of another shape.
    """
    if backend not in ("auto", "torch", "reference"):
        raise PlanError(
            f"choosing ahead searches with the 'torch' or 'reference' builder; got backend "
            f"{backend!r} (the cuda backend plans exact balance only)"
        )
    c_RE, N = checked_counts(counts_RE)
    R, E = c_RE.shape
    B = check_options(slots, align, max_local(E, R), c_RE, total=N)
    prev = Before.of(before) if isinstance(before, Plan) else before
    if prev is not None and (*prev.slot_expert.shape, prev.num_experts) != (R, B, E):
        raise PlanError(
            f"the previous plan has (R, B, E) = {(*prev.slot_expert.shape, prev.num_experts)}, "
            f"this call has {(R, B, E)}"
        )
    builder = "reference" if backend == "reference" else "torch"
    host = c_RE.to("cpu")
    if prev is None:
        return search(Inputs(host, B, align, None, None, builder), cost)
    inp = Inputs(host, B, align, prev.slot_expert, prev.flow, builder, prev.policy, prev.basis)
    return search(inp, cost)


class AheadChoice:
    """One layer's choose-ahead state: the candidate named for the next step.

    Use: ``p = plan(counts, previous=last, policy=ahead.policy(), cost=cost)`` on the
    critical path, then ``ahead.update(counts, p, previous=last, cost=cost)`` (or
    ``ahead.settle(name, p, basis=found.basis)`` with ``found`` searched elsewhere, e.g.
    by a host thread running :func:`choose_next` from host copies of :meth:`start`,
    :meth:`Before.of`).
    """

    def __init__(self) -> None:
        self._before: Plan | None = None  # plan of the step before the last one
        self._next: str | None = None  # candidate named for the next step
        self._next_basis: Basis | None = None  # the basis of the search that named it

    @property
    def before(self) -> Plan | None:
        """The plan the next choice starts from (the last step's ``previous``), with the
        basis of the search that named its candidate (what inline ``auto``'s previous
        plan carries: the keep test reads it)."""
        return self._before

    def policy(self) -> str:
        """The ``policy=`` of the next step: the named candidate, or ``"auto"`` before
        the first choice (inline)."""
        return "auto" if self._next is None else self._next

    def update(
        self,
        counts_RE: object,
        p: Plan,
        *,
        previous: Plan | None,
        cost: CostModel,
        slots: int | None = None,
        align: int = 1,
        backend: str = "torch",
    ) -> Choice:
        """Choose the next step's candidate now (in the caller) from this step's counts
        and ``p`` (this step's plan); returns the search's :class:`Choice` (its work,
        its scores).

        ``previous``: the plan this step was built from (the search starts from
        :meth:`start` of it: the search inline ``"auto"`` would have run at this step)."""
        start = self.start(previous)
        found = choose_next(counts_RE, start, cost=cost, slots=slots, align=align, backend=backend)
        self.settle(found.policy, p, basis=found.basis)
        return found

    def start(self, previous: Plan | None) -> Plan | None:
        """What the search of a step built from ``previous`` starts from: :attr:`before`
        (``previous`` with the basis handed on) when it is that plan, else ``previous``
        itself (no search recorded yet, after :meth:`reset`, or residents dropped)."""
        b = self._before
        if previous is None or b is None or b.alloc is not previous.alloc:
            return previous
        return b

    def settle(self, name: str, p: Plan, *, basis: Basis | None = None) -> None:
        """Record ``name`` as the next step's candidate (``basis``: that of the search that
        named it, ``found.basis``) and ``p`` as this step's plan. ``p`` keeps its own
        basis when it was chosen inline (no candidate named before it), else it takes
        the basis of the search that named its candidate."""
        own = p.basis if self._next is None else self._next_basis
        self._before = p if own is p.basis else dataclasses.replace(p, basis=own)
        self._next, self._next_basis = name, basis

    def reset(self) -> None:
        """Forget the history (the next step chooses inline)."""
        self._before, self._next, self._next_basis = None, None, None
