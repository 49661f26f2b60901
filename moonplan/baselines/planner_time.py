"""The device time the simulator charges moonplan's planner, by shape ``(R, E)``.

Legend: R ranks (EP size), E experts; times in microseconds.

**Measured** on an H200 (``docs/benchmarks.md``): the fused exact
kernel (``csrc/plan_kernel.cu``, 2026-11-30, :data:`MEASURED`) and the whole
``plan(policy="auto")`` call (``csrc/choice_kernel.cu`` and the launches around it,
2026-12-04, after its contended atomics were removed: the device time of its kernels per
call, ``bench/gpu_profile.py``, which was within 3% of its CUDA-graph replay before that
change): every candidate built and scored (:data:`MEASURED_AUTO`, :func:`auto_us`) and
the early exit (:data:`MEASURED_EXIT`, :func:`exit_us`; it includes the exit's
``resident`` build where it ran, 4 rounds there).
Each is interpolated the same way (:func:`_at`): linearly in ``R`` at ``E = 896``
through the points measured there (extrapolated beyond them with the end segments'
slopes), plus ``E``'s slope measured at ``R = 8`` (256 and 896 experts) for other ``E``;
never below :data:`FLOOR_US`.

**Estimated until a GPU run measures it:** :data:`ROUND_US`, one round of the
``resident`` candidate's diffusion (a few block-wide passes over the pairs), charged what
one rank's step of the exact kernel's balance loop costs, the slope of :data:`MEASURED`
in ``R``. A build runs as many rounds as pay for themselves
(``moonplan.plan.choice.resident``), in each rounding it builds, and the plan reports
them (``Choice.rounds``). The simulator charges them beside the exit's test and on top
of a full call: both measured figures already hold 4 rounds, so the charge is an upper
bound. :func:`resident_us` is a build of ``rounds`` rounds after the exit's pass.

The MoonEP greedy is charged its published 51 us a step (``baselines.moonep_greedy``).
"""

from __future__ import annotations

MEASURED = {(8, 256): 13.5, (8, 896): 20.8, (64, 896): 62.2, (256, 896): 225.0}
"""Fused exact kernel, CUDA-graph replay, H200 (us), by ``(R, E)``."""

MEASURED_AUTO = {(8, 256): 190.7, (8, 896): 397.4, (64, 896): 864.2}
"""``plan(policy="auto")``, every candidate built and scored, device time per call, H200 (us)."""

MEASURED_EXIT = {(8, 256): 151.5, (8, 896): 319.7, (64, 896): 664.8}
"""``plan(policy="auto")`` taking the early exit, device time per call, H200 (us)."""

FLOOR_US = 5.0
"""No planner call is charged less (a kernel's launch in a graph and its first pass)."""


def _at(measured: dict[tuple[int, int], float], num_ranks: int, num_experts: int) -> float:
    """``measured`` interpolated at ``(R, E)`` (module docstring)."""
    pts = sorted((r, t) for (r, e), t in measured.items() if e == 896)
    i = 0
    while i + 2 < len(pts) and num_ranks > pts[i + 1][0]:
        i += 1  # the segment R falls on (or extends)
    (r0, t0), (r1, t1) = pts[i], pts[i + 1]
    at_896 = t0 + (t1 - t0) * (num_ranks - r0) / (r1 - r0)
    e_slope = (measured[(8, 896)] - measured[(8, 256)]) / (896 - 256)
    return max(FLOOR_US, at_896 + e_slope * (num_experts - 896))


def exact_us(num_ranks: int, num_experts: int) -> float:
    """Microseconds of the exact kernel at ``(R, E)`` (module docstring)."""
    return _at(MEASURED, num_ranks, num_experts)


def auto_us(num_ranks: int, num_experts: int) -> float:
    """Microseconds of ``policy="auto"`` building and scoring every candidate."""
    return _at(MEASURED_AUTO, num_ranks, num_experts)


ROUND_US = (MEASURED[(64, 896)] - MEASURED[(8, 896)]) / (64 - 8)
"""Microseconds of one round of the ``resident`` candidate's diffusion in one rounding
(module docstring); the records and tiles roundings run their rounds one after the other
(the kernel does not share them), so each round of either is charged."""


def resident_us(num_ranks: int, num_experts: int, rounds: int) -> float:
    """Microseconds of a ``resident`` candidate build of ``rounds`` rounds in all and its
    pass over the counts (module docstring)."""
    return exit_us(num_ranks, num_experts) + rounds * ROUND_US


def exit_us(num_ranks: int, num_experts: int) -> float:
    """Microseconds of ``policy="auto"``'s early exit (the test and what it builds)."""
    return _at(MEASURED_EXIT, num_ranks, num_experts)
