"""The host time the simulator charges a slot-placement decision, by shape ``(R, E)``.

Legend: R ranks (EP size), E experts; times in microseconds.

A decision of the slot placement (``moonplan.plan.residency.refill.Decisions``) runs on a
host thread, in the runtime as in the simulator: numpy for the tables, torch ops on the
CPU for their scores over the window (``moonplan.plan.residency.window_torch``). It counts
its work (``moonplan.plan.residency.work``): the builds of the ``resident`` candidate it
makes (only where the exit's gate lets one through) and the (step, table) pairs it scores
without one. Its answer is used once the steps covering that work at ``StepCost.decide_s``
a build and ``StepCost.score_s`` a pair have passed. The runtime's calibration times both
rates on its own host (``refill.time_rates``); the simulator charges
:func:`decision_build_us` and :func:`decision_score_us`.

**Measured** (``bench/bench_decision.py``, ``docs/benchmarks.md``, 2026-12-04, this
project's 2-core development machine, one thread, beside a sweep on the other core):
``time_rates`` at its eight cases, twice: 169-5248 us a build and 59-994 us a pair. Both
grow with ``R * E`` (every rank's share of every expert), so each rate is a line in
``R * E``, the least squares of the logarithms over the sixteen points (the script's
``fit_line``; each measured rate 0.64-1.66x its line). The eight cases' whole decisions on
their windows took 0.66-1.67x what the lines charge. (The lines fitted on 2026-12-03
charged 1.9-2.8x the decisions of the code since: the builds the gate stops and the
batched scores made them cheaper.) A server's host core may be faster; until a GPU host
measures it, the simulator charges this machine's figure.
"""

from __future__ import annotations

BASE_US = 151.3
"""Host microseconds per counted build that do not grow with the shape (the numpy tables,
the calls' overhead): the line's value at ``R * E = 0``."""

PER_PAIR_US = 0.2191
"""Host microseconds per counted build and ``(rank, expert)`` pair: the line's slope."""


def decision_build_us(num_ranks: int, num_experts: int) -> float:
    """Host microseconds per build a slot-placement decision counts at ``(R, E)`` (module
    docstring)."""
    return BASE_US + PER_PAIR_US * num_ranks * num_experts


SCORE_BASE_US = 52.0
"""Host microseconds per (step, table) scored without a build that do not grow with the
shape: the line's value at ``R * E = 0``."""

SCORE_PER_PAIR_US = 0.0466
"""Host microseconds per (step, table) scored and ``(rank, expert)`` pair: the slope."""


def decision_score_us(num_ranks: int, num_experts: int) -> float:
    """Host microseconds per (step, table) a slot-placement decision scores without a
    build at ``(R, E)`` (module docstring)."""
    return SCORE_BASE_US + SCORE_PER_PAIR_US * num_ranks * num_experts
