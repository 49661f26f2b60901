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

Every input is all-gathered or derived from all-gathered data, so every rank names
the same candidate, as inline ``"auto"`` does.
"""

from __future__ import annotations

import dataclasses

from moonplan.plan.api import plan
from moonplan.plan.choose import CostModel
from moonplan.plan.plan_type import Basis, Plan


def choose_next(
    counts_RE: object,
    before: Plan | None,
    *,
    cost: CostModel,
    slots: int | None = None,
    align: int = 1,
    backend: str = "torch",
) -> Plan:
    """``policy="auto"``'s plan of step ``t``'s counts from step ``t - 1``'s plan.

    Args:
        counts_RE: step ``t``'s counts ``[R, E]`` (anything ``moonplan.plan`` accepts).
        before: the plan of step ``t - 1`` (``None``: no resident slots).
        cost, slots, align, backend: as for ``moonplan.plan``.

    Returns:
        The auto :class:`Plan`; its ``policy`` names step ``t + 1``'s candidate and its
        ``planned``/``chose`` are the search's work (off the critical path).
    """
    return plan(
        counts_RE,
        slots=slots,
        align=align,
        previous=before,
        backend=backend,
        policy="auto",
        cost=cost,
    )


class AheadChoice:
    """One layer's choose-ahead state: the candidate named for the next step.

    Use: ``p = plan(counts, previous=last, policy=ahead.policy(), cost=cost)`` on the
    critical path, then ``ahead.update(counts, p, previous=last, cost=cost)`` (or
    ``ahead.settle(name, p, basis=found.basis)`` with ``found`` searched elsewhere, e.g.
    by a host thread running :func:`choose_next` from :meth:`start`).
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
    ) -> Plan:
        """Choose the next step's candidate now (in the caller) from this step's counts
        and ``p`` (this step's plan); returns the search's plan (its work, its scores).

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
