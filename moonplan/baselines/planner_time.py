"""The device time the simulator charges moonplan's planner, by shape ``(R, E)``.

Legend: R ranks (EP size), E experts; times in microseconds.

**Measured** (``docs/benchmarks.md``, "First GPU session", H200, 2026-11-30): the fused
exact kernel (``csrc/plan_kernel.cu``) in CUDA-graph replay, the shapes of
:data:`MEASURED`. :func:`exact_us` interpolates them: linearly in ``R`` at ``E = 896``
through the three points measured there (extrapolated below ``R = 8`` and above
``R = 256`` with the end segments' slopes; the kernel's sequential balance loop makes
``R`` its leading term), plus ``E``'s slope measured at ``R = 8`` (256 and 896 experts:
0.0114 us per expert) for other ``E``; never below :data:`FLOOR_US`.

**Estimated until a GPU run measures them** (``bench/gpu_check.py`` times both):

* :func:`auto_us`, ``policy="auto"`` building and scoring every candidate: the candidates'
  constructions run in parallel blocks, each as long as the exact kernel's, then a pass
  over ``E * R`` per block scores them and one block lays out the winner; charged
  :data:`AUTO_FACTOR` times :func:`exact_us`.
* :data:`ROUND_US`, one round of the ``resident`` candidate's diffusion (a few block-wide
  passes over the pairs), charged what one rank's step of the exact kernel's balance
  loop costs, the slope of :data:`MEASURED` in ``R``; a build runs as many rounds as pay
  for themselves (``moonplan.plan.choice.resident``), in each rounding it builds, and the
  plan reports them (``Choice.rounds``). The simulator charges them beside the exit's test,
  and on top of a full call: the exit's build runs before the call's other blocks; the
  call's own (where the exit built none) beside them, so charging it on top is an upper
  bound (``rent.call_rounds_s``). :func:`resident_us` is a build of ``rounds`` rounds
  after the pass over the counts that :func:`exit_us` charges;
* :func:`exit_us`, ``auto``'s early exit: the test reads the counts once more in the pass
  that every plan (static EP's too) makes over them, and reduces a few sums in one block:
  ``E * R * 8`` bytes at :data:`ONE_SM_BYTES_PER_S` plus :data:`REDUCE_US`. Static EP's
  own layout pass is charged to no policy (the simulator's peers pay none either).

The MoonEP greedy is charged its published 51 us a step (``baselines.moonep_greedy``).
"""

from __future__ import annotations

MEASURED = {(8, 256): 13.5, (8, 896): 20.8, (64, 896): 62.2, (256, 896): 225.0}
"""Fused exact kernel, CUDA-graph replay, H200 (us), by ``(R, E)``."""

FLOOR_US = 5.0
"""No planner call is charged less (a kernel's launch in a graph and its first pass)."""

AUTO_FACTOR = 1.5
"""``auto``'s full call over the exact kernel: one more pass per block and a layout launch."""

ONE_SM_BYTES_PER_S = 200e9
"""What one block reads from global memory per second (an H200 SM, order of magnitude)."""

REDUCE_US = 0.5
"""The exit test's block reductions and comparisons."""

_R_POINTS = ((8, 20.8), (64, 62.2), (256, 225.0))  # E = 896
_E_SLOPE = (20.8 - 13.5) / (896 - 256)  # us per expert at R = 8
_R_SLOPE = (62.2 - 20.8) / (64 - 8)  # us per rank at E = 896: one step of the balance loop


def exact_us(num_ranks: int, num_experts: int) -> float:
    """Microseconds of the exact kernel at ``(R, E)`` (module docstring)."""
    R, E = num_ranks, num_experts
    pts = _R_POINTS
    i = 0 if R <= pts[1][0] else 1  # the segment R falls on (or extends)
    (r0, t0), (r1, t1) = pts[i], pts[i + 1]
    at_896 = t0 + (t1 - t0) * (R - r0) / (r1 - r0)
    return max(FLOOR_US, at_896 + _E_SLOPE * (E - 896))


def auto_us(num_ranks: int, num_experts: int) -> float:
    """Microseconds of ``policy="auto"`` building and scoring every candidate."""
    return AUTO_FACTOR * exact_us(num_ranks, num_experts)


ROUND_US = _R_SLOPE
"""Microseconds of one round of the ``resident`` candidate's diffusion in one rounding
(module docstring); the records and tiles roundings run their rounds one after the other
(the kernel does not share them), so each round of either is charged."""


def resident_us(num_ranks: int, num_experts: int, rounds: int) -> float:
    """Microseconds of a ``resident`` candidate build of ``rounds`` rounds in all and its
    pass over the counts (module docstring)."""
    return exit_us(num_ranks, num_experts) + rounds * ROUND_US


def exit_us(num_ranks: int, num_experts: int) -> float:
    """Microseconds of ``policy="auto"``'s early exit (the test alone)."""
    return REDUCE_US + num_ranks * num_experts * 8 / ONE_SM_BYTES_PER_S * 1e6
