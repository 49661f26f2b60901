"""The host time the simulator charges a slot-placement decision, by shape ``(R, E)``.

Legend: R ranks (EP size), E experts; times in microseconds.

A decision of the slot placement (``moonplan.plan.residency.refill.Decisions``) runs in
numpy on a host thread, in the runtime as in the simulator, and counts the builds of the
``resident`` candidate it makes. Its answer is used once the steps covering those builds
at ``StepCost.decide_s`` each have passed. The runtime's calibration times that rate on its
own host; the simulator charges :func:`decision_build_us`.

**Measured** (``bench/bench_decision.py``, ``docs/benchmarks.md``, 2026-12-03, this
project's 2-core development machine, one thread, shared with a sweep): host time over
builds counted, 2.1-3.0 ms at ``R * E = 64`` (Mixtral, EP 8) and 8.0-12.5 ms at
``R * E = 16384`` (DeepSeek-V3, EP 64). :func:`decision_build_us` is the power law
through the two ends' middles (:data:`AT_64_US`, :data:`EXPONENT`); the points between
(OLMoE and DeepSeek-V3 at EP 8) lie within its spread. A server's host core may be
faster; until a GPU host measures it, the simulator charges this machine's figure.
"""

from __future__ import annotations

AT_64_US = 2500.0
"""Host microseconds per counted build at ``R * E = 64`` (measured 2.1-3.0 ms)."""

EXPONENT = 0.25
"""The power of ``R * E / 64``: 256x the pairs took 4x the time per build (10 ms at
``R * E = 16384``, measured 8.0-12.5 ms)."""


def decision_build_us(num_ranks: int, num_experts: int) -> float:
    """Host microseconds per build a slot-placement decision counts at ``(R, E)`` (module
    docstring)."""
    return AT_64_US * (num_ranks * num_experts / 64) ** EXPONENT
