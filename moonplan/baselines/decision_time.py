"""The host time the simulator charges a slot-placement decision, by shape ``(R, E)``.

Legend: R ranks (EP size), E experts; times in microseconds.

A decision of the slot placement (``moonplan.plan.residency.refill.Decisions``) runs on a
host thread, in the runtime as in the simulator: numpy for the tables, torch ops on the
CPU for their scores over the window (``moonplan.plan.residency.window_torch``). It counts
the builds of the ``resident`` candidate it makes. Its answer is used once the steps
covering those builds at ``StepCost.decide_s`` each have passed. The runtime's calibration
times that rate on its own host; the simulator charges :func:`decision_build_us`.

**Measured** (``bench/bench_decision.py``, ``docs/benchmarks.md``, 2026-12-03, this
project's 2-core development machine, one thread, every table scored in one call): host
time over builds counted, 0.38 ms at ``R * E = 64`` (Mixtral, EP 8), 0.49 ms at 512
(OLMoE, EP 8), 1.1-1.8 ms at 2048 (DeepSeek-V3, EP 8) and 10.0-10.1 ms at 16384
(DeepSeek-V3, EP 64). The torch scores' work grows with ``R * E`` (every rank's share of
every expert), so the rate is a line in ``R * E`` (:data:`BASE_US`, :data:`PER_PAIR_US`,
the least squares of the logarithms over those seven points); each measured point is
0.76-1.27x the line. A server's host core may be faster; until a GPU host measures it,
the simulator charges this machine's figure.
"""

from __future__ import annotations

BASE_US = 305.0
"""Host microseconds per counted build that do not grow with the shape (the numpy tables,
the calls' overhead): the line's value at ``R * E = 0``."""

PER_PAIR_US = 0.56
"""Host microseconds per counted build and ``(rank, expert)`` pair: the line's slope."""


def decision_build_us(num_ranks: int, num_experts: int) -> float:
    """Host microseconds per build a slot-placement decision counts at ``(R, E)`` (module
    docstring)."""
    return BASE_US + PER_PAIR_US * num_ranks * num_experts
