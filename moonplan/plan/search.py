"""The lean choose-ahead search: ``policy="auto"``'s choice by name, nothing laid out.

Legend: R ranks, E experts, B slots; ``counts_RE`` int64 ``[R, E]`` (host).

Choosing ahead (``moonplan.plan.ahead``) needs only the *name* of the candidate
``policy="auto"`` would choose (and what it saw: scores, work, basis); the next step
builds that candidate on its own counts. :func:`search` runs the same choice as
:func:`~moonplan.plan.choose.choose` (``choose.decide``: the same screens, the same
scores, the same winner) but builds no :class:`~moonplan.plan.plan_type.Plan`:

* a balancing candidate is scored from its allocation (``moonplan.plan.score_alloc``:
  the construction's steps 1-2, the fetched pairs from the allocation and the
  previous slots, ``cost.step_time``), never laid out;
* a fetch-free winner (``static``, ``resident``) is not laid out;
* a step that keeps the previous choice (``moonplan.plan.keep``) builds nothing: it
  names the previous candidate with ``planned=0`` (inline ``choose`` builds it, and
  its plan records that construction as ``planned``).

Its :class:`Choice` equals ``choose``'s plan's ``(policy, predicted, planned, chose,
basis)`` on the same inputs (``tests/plan/test_search.py``), but on a kept step,
where ``planned`` is 0 instead of the kept candidate's construction.
"""

from __future__ import annotations

import dataclasses

from moonplan.plan.choose import (
    TABLE,
    WORK,
    Candidate,
    CostModel,
    Inputs,
    decide,
    kept_basis,
)
from moonplan.plan.keep import keeps
from moonplan.plan.plan_type import Basis, Predicted


@dataclasses.dataclass(frozen=True)
class Choice:
    """What a choose-ahead search found (:func:`search`): what its callers read.

    Attributes:
        policy: the candidate named for the next step (``policy=`` of ``moonplan.plan``).
        predicted: candidate -> score of every candidate scored (empty on a kept step).
        planned: planner runs the search made (the constructions it scored; 0 on a
            kept step: nothing is built, unlike inline ``choose``, whose kept plan
            counts its own construction).
        chose: the search's own work beyond those runs, in construction equivalents
            (``moonplan.plan.choose.WORK``; ``WORK["keep"]`` on a kept step).
        basis: the basis of the full choice this one keeps or makes (``Plan.basis``).
        cut: balancing candidates the search left out to stay within its work budget
            (:func:`search`'s ``budget``; 0 without one).

    The simulator charges ``planned + chose`` construction equivalents of background
    work to the search (``moonplan.baselines.policies``).
    """

    policy: str
    predicted: Predicted
    planned: int
    chose: float
    basis: Basis | None
    cut: int = 0


def search(
    inp: Inputs,
    cost: CostModel,
    table: tuple[Candidate, ...] | None = None,
    budget: float | None = None,
) -> Choice:
    """``policy="auto"``'s choice among ``table``'s candidates (default
    :data:`~moonplan.plan.choose.TABLE`) on ``inp``, by name (module docstring);
    ``budget``: the most work it may spend (``moonplan.plan.choose.decide``), ``None``
    for none (the same choice as inline ``"auto"``)."""
    table = TABLE if table is None else table
    load = inp.static_load
    if keeps(inp, load, cost):
        assert inp.prev_basis is not None and inp.prev_policy is not None
        return Choice(inp.prev_policy, Predicted(), 0, WORK["keep"], kept_basis(inp.prev_basis))
    d = decide(inp, cost, load, table, lean=True, budget=budget)
    return Choice(d.name, d.predicted, d.planned, d.chose, d.basis, d.cut)
