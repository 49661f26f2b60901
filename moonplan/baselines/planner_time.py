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
* :func:`resident_us`, one build of the ``resident`` candidate (``ROUNDS`` rounds of
  block-wide passes over the pairs, each charged what one rank's step of the exact
  kernel's balance loop costs, the slope of :data:`MEASURED` in ``R``, once for each of
  its :data:`ROUNDINGS`), after the pass
  over the counts that :func:`exit_us` charges: what a window placement's evaluation
  costs per table it scores (``moonplan.plan.residency``);
* :func:`exit_us`, ``auto``'s early exit: the test reads the counts once more in the pass
  that every plan (static EP's too) makes over them, and reduces a few sums in one block:
  ``E * R * 8`` bytes at :data:`ONE_SM_BYTES_PER_S` plus :data:`REDUCE_US`. Static EP's
  own layout pass is charged to no policy (the simulator's peers pay none either).

The MoonEP greedy is charged its published 51 us a step (``baselines.moonep_greedy``).
"""

from __future__ import annotations

from moonplan.plan.choice.resident import ROUNDS

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


def resident_us(num_ranks: int, num_experts: int, tile_rows: int) -> float:
    """Microseconds of one ``resident`` candidate build and its pass over the counts
    (module docstring); the build alone is :func:`resident_build_us`."""
    return exit_us(num_ranks, num_experts) + resident_build_us(tile_rows)


ROUNDINGS = 2
"""Builds of the ``resident`` candidate a step where the GEMM tile is over one row: its
diffusion rounded to whole records and to whole tiles, each run and scored on its own (the
kernel does not share their rounds), so both are charged. With one-row tiles the two are
one, and the kernel builds it once."""


def resident_build_us(tile_rows: int) -> float:
    """Microseconds of the ``resident`` candidate's rounds: what ``auto``'s early exit adds
    to its test where replicas are resident (it builds and scores that candidate too, in
    both roundings where ``tile_rows > 1``)."""
    return (ROUNDINGS if tile_rows > 1 else 1) * ROUNDS * _R_SLOPE


def exit_us(num_ranks: int, num_experts: int) -> float:
    """Microseconds of ``policy="auto"``'s early exit (the test alone)."""
    return REDUCE_US + num_ranks * num_experts * 8 / ONE_SM_BYTES_PER_S * 1e6
