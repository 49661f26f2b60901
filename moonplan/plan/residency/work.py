"""A slot-placement decision's work, counted as it runs, and the host seconds it stands for.

Legend: none (counts and seconds).

A decision (``moonplan.plan.residency.refill.Decisions``) runs on a host thread, and every
rank must use its answer at the same step, so it reads no clock: it counts its work as it
runs, and that work's seconds are the counts at the cost model's host rates:

* ``made``: builds of the ``resident`` candidate (one step's plan inside one slot table;
  static EP's plan over empty slots, built on the host, counts as one), each at
  ``StepCost.decide_s``;
* ``scored``: (step, table) pairs scored without that build (static EP's step over the
  window; a table's links, its ``placed`` plan, and the exit's gate and bound), each at
  ``StepCost.score_s``. The window's scores build the ``resident`` candidate only where
  the exit's gate lets it through (``moonplan.plan.residency.window_torch``), so a pair's
  build is counted in ``made`` only there.

Where a rate is 0 (not calibrated), the device's rate ``StepCost.exit_s`` stands in for
it (a step may then wait for the host: ``docs/runtime.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

from moonplan.stepcost import StepCost


@dataclass
class Builds:
    """A decision's work (module docstring): ``made`` builds and ``scored`` pairs."""

    made: int = 0
    scored: int = 0


def build_rate(cost: StepCost) -> float:
    """Seconds per build a decision counts: ``cost.decide_s``, or where it is not set,
    ``cost.exit_s``."""
    return cost.decide_s if cost.decide_s > 0 else cost.exit_s


def score_rate(cost: StepCost) -> float:
    """Seconds per (step, table) a decision scores without a build: ``cost.score_s``, or
    where it is not set, ``cost.exit_s``."""
    return cost.score_s if cost.score_s > 0 else cost.exit_s


def work_s(cost: StepCost, builds: Builds) -> float:
    """Host seconds of a decision's counted work at ``cost``'s rates."""
    return builds.made * build_rate(cost) + builds.scored * score_rate(cost)
