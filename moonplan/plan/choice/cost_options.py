"""The ``StepCost`` options ``policy="auto"`` models, and the check that refuses the others.

Legend: none (no tensors).

Every form of the choice (reference, host, tensor, the CUDA kernel) scores a candidate from
the counts and its allocation alone. That fixes what it can model:

* every rate (``row_flop_s`` ... ``round_s``), ``tile_rows``, ``domain`` and either schedule
  (``overlap``); ``horizon`` is deprecated and ignored by every form;
* only the ``"record"`` dispatch scheme: a row per record, routed from the counts. The
  ``"rank"`` and ``"host"`` schemes send one row per unique (token, destination), which
  needs each record's token, and a planner given counts does not have them
  (``StepCost.step_time(traffic=...)``).

:func:`check_cost` raises :class:`~moonplan.errors.PlanError` for anything else, on every
path, before any work: the torch and CUDA forms would otherwise score the ``"record"``
rows without a word. A field this list does not name (a ``StepCost`` subclass, or a field
added later) is refused unless it holds its default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moonplan.errors import PlanError
from moonplan.stepcost.step_cost import StepCost

RATES = (
    "row_flop_s", "weight_read_s", "row_mem_s", "copy_s_intra", "copy_s_inter",
    "dispatch_row_s_intra", "dispatch_row_s_inter", "combine_row_s_intra",
    "combine_row_s_inter", "base_latency_s", "per_peer_latency_s", "plan_s", "exit_s", "round_s",
)  # fmt: skip
"""The rates the choice reads (any finite value ``>= 0``, as ``StepCost`` accepts)."""

OPTIONS = (
    "tile_rows", "domain", "overlap", "horizon", "dispatch", "decide_s", "score_s", "exact_s",
)  # fmt: skip
"""The other fields it reads or ignores by design (``horizon``: deprecated, ignored;
``decide_s``, ``score_s``: the slot placement's host rates, not a step's planning;
``exact_s``: the exact call the slot placement may serve instead of this one)."""

DISPATCH = ("record",)
"""The dispatch schemes it scores."""


def check_cost(cost: StepCost) -> None:
    """Raise :class:`PlanError` unless every form of the choice models ``cost`` (module
    docstring): the ``"record"`` dispatch scheme, and no field beyond :data:`RATES` and
    :data:`OPTIONS` away from its default."""
    if cost.dispatch not in DISPATCH:
        raise PlanError(
            f"policy='auto' scores only the {DISPATCH} dispatch scheme (a row per record, "
            f"from the counts); got StepCost.dispatch={cost.dispatch!r}. Plan with "
            "cost.scaled(dispatch='record'), and predict the step with the scheme's traffic "
            "(StepCost.step_time(traffic=...))"
        )
    for f in dataclasses.fields(cost):
        if f.name in RATES or f.name in OPTIONS:
            continue
        value = getattr(cost, f.name)
        if not _is_default(f, value):
            raise PlanError(
                f"policy='auto' does not model StepCost.{f.name} (got {value!r}); the choice "
                f"reads {RATES + OPTIONS} only (moonplan/plan/choice/cost_options.py)"
            )


def _is_default(f: dataclasses.Field[Any], value: object) -> bool:
    """Whether ``value`` is field ``f``'s default (a required field has none)."""
    if f.default is not dataclasses.MISSING:
        return bool(value == f.default)
    if f.default_factory is not dataclasses.MISSING:
        return bool(value == f.default_factory())
    return False
