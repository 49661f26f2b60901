"""What a layer step tells a profiler, and the step's own clock: no-op hooks when off.

Legend:
    span   one timed phase of one step of one layer on one rank: start and end, in
           seconds (``time.perf_counter``), or a pair of CUDA events on CUDA

The runtime owns this interface (docs/design.md §5): ``LayerRuntime.profiler`` is a
:class:`LayerHooks`, :data:`NULL_PROFILER` unless :mod:`moonplan.profiling.session`,
which sits above the runtime, installs its live ones. :class:`StepClock` adds each
phase's seconds to the step's figures (``StepStats.phases``) and hands its span to the
step's hooks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from moonplan.runtime.background import Pending

__all__ = ["NULL_PROFILER", "LayerHooks", "NullProfiler", "StepClock", "StepHooks"]


class StepHooks(Protocol):
    """What a step reports while it runs (:class:`NullProfiler`, or the profiler's
    ``StepRecorder``)."""

    def begin(self) -> None: ...

    def span(self, name: str, t0: float, t1: float) -> None: ...

    def background(
        self, name: str, t0: float, t1: float, events: Any = None, *, host: bool = False
    ) -> None: ...

    def traffic(self, records: int, rows_sent: int) -> None: ...


class LayerHooks(Protocol):
    """A layer's hooks (:class:`NullProfiler`, or the profiler's ``LayerProfiler``): one
    :class:`StepHooks` per step, its first sequence of phases already begun."""

    def begin_step(self) -> StepHooks: ...


class NullProfiler:
    """The hooks of a layer that is not profiled: every call returns at once.

    It has no attributes at all (``__slots__ = ()``), so the one module constant
    :data:`NULL_PROFILER` is shared by every layer without shared mutable state. It
    plays both roles: a :class:`LayerHooks` (``begin_step``) and a :class:`StepHooks`
    (``begin``, ``span``).
    """

    __slots__ = ()

    def begin_step(self) -> NullProfiler:
        """Start a step: returns itself (a recorder that records nothing)."""
        return self

    def begin(self) -> None:
        """Start a sequence of contiguous phases (nothing to do)."""

    def span(self, name: str, t0: float, t1: float) -> None:
        """Phase ``name`` ran from ``t0`` to ``t1`` (``perf_counter`` seconds): ignored."""

    def background(
        self, name: str, t0: float, t1: float, events: Any = None, *, host: bool = False
    ) -> None:
        """Background phase ``name`` ran from ``t0`` to ``t1``: ignored."""

    def traffic(self, records: int, rows_sent: int) -> None:
        """The step's records and rows sent (``StepStats``): ignored."""


NULL_PROFILER = NullProfiler()
"""Immutable no-op hooks; the default of ``LayerRuntime.profiler``."""


@dataclass
class StepClock:
    """The phases of one step: their seconds, summed per name (``phases``: the dict
    ``StepStats.phases`` shows, which the step's backward extends), and each span handed
    to the step's ``hooks``."""

    hooks: StepHooks = NULL_PROFILER
    phases: dict[str, float] = field(default_factory=dict)

    def span(self, name: str, t0: float, t1: float) -> None:
        """Phase ``name`` ran from ``t0`` to ``t1`` (``perf_counter`` seconds)."""
        self.phases[name] = self.phases.get(name, 0.0) + t1 - t0
        self.hooks.span(name, t0, t1)

    def tick(self, name: str, t0: float) -> float:
        """Phase ``name`` ran from ``t0`` until now; returns now (where the next starts)."""
        t = time.perf_counter()
        self.span(name, t0, t)
        return t

    def background(self, name: str, pending: Pending) -> None:
        """Record the background job ``pending`` (done) as phase ``name`` (its run time)."""
        self.phases[name] = self.phases.get(name, 0.0) + pending.run_s
        self.hooks.background(name, *pending.span, pending.events)
