"""The per-step hooks a ``LayerRuntime`` calls: no-op when off, live when profiling.

Legend:
    span   one timed phase of one step of one layer on one rank: start and end, in
           seconds (``time.perf_counter``), or a pair of CUDA events on CUDA

These sit below the runtime (docs/design.md §5): ``moonplan.runtime`` imports them
from here, and :mod:`moonplan.profiling.session` (which finds runtimes in a model) re-exports
them, so the profiler and the runtime do not import each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from moonplan.profiling.session import Profiler

__all__ = ["NULL_PROFILER", "LayerProfiler", "NullProfiler", "StepHooks", "StepRecorder"]


class StepHooks(Protocol):
    """What a step reports while it runs (:class:`NullProfiler` or :class:`StepRecorder`)."""

    def begin(self) -> None: ...

    def span(self, name: str, t0: float, t1: float) -> None: ...

    def background(
        self, name: str, t0: float, t1: float, events: Any = None, *, host: bool = False
    ) -> None: ...

    def traffic(self, records: int, rows_sent: int) -> None: ...


class NullProfiler:
    """The hooks of a layer that is not profiled: every call returns at once.

    It has no attributes at all (``__slots__ = ()``), so the one module constant
    :data:`NULL_PROFILER` is shared by every layer without shared mutable state. It
    plays both roles of the live objects: a :class:`LayerProfiler` (``begin_step``)
    and a :class:`StepRecorder` (``begin``, ``span``).
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


class StepRecorder:
    """Records the phases of one step of one layer (forward, then maybe backward).

    ``begin()`` opens a sequence of contiguous phases (the forward, the backward);
    ``span(name, t0, t1)`` closes phase ``name``, which ran from ``t0`` to ``t1``
    (``perf_counter`` seconds). On CUDA the phase is the stream time between the
    previous boundary event and an event recorded by this call.
    """

    __slots__ = ("_mark", "_prof", "layer", "step")

    def __init__(self, prof: Profiler, layer: int, step: int):
        self._prof, self.layer, self.step = prof, layer, step
        self._mark: Any = None

    def begin(self) -> None:
        """Open a sequence of phases (a barrier first when the profiler is ``aligned``)."""
        if self._prof.aligned:
            self._prof.group.barrier()
        self._mark = self._prof.mark()

    def span(self, name: str, t0: float, t1: float) -> None:
        """Phase ``name`` ran from ``t0`` to ``t1`` (host seconds) and ends now."""
        end = self._prof.mark()
        self._prof.add(self.layer, self.step, name, (t0, t1), (self._mark, end))
        self._mark = end

    def background(
        self, name: str, t0: float, t1: float, events: Any = None, *, host: bool = False
    ) -> None:
        """Background phase ``name`` (a worker thread's or side stream's job) ran from
        ``t0`` to ``t1`` (host seconds, measured where it ran) or, on CUDA, between the
        side-stream ``events`` (start, end). ``host``: a host thread's job (no device
        work), kept on the host clock on CUDA too. It does not move the sequence's
        boundary."""
        if self._prof.cuda and events is None and not host:
            return  # inline job: its time is already inside the critical-path phases
        self._prof.add(self.layer, self.step, name, (t0, t1), events or (None, None))

    def traffic(self, records: int, rows_sent: int) -> None:
        """The step's records and the rows its dispatch sent (``StepStats``)."""
        self._prof.add_traffic(records, rows_sent)


class LayerProfiler:
    """The live hooks of one profiled layer: numbers its steps, hands out recorders."""

    __slots__ = ("_prof", "layer", "steps")

    def __init__(self, prof: Profiler, layer: int):
        self._prof, self.layer, self.steps = prof, layer, 0

    def begin_step(self) -> StepRecorder:
        """A recorder for this layer's next step, its first sequence already begun."""
        rec = StepRecorder(self._prof, self.layer, self.steps)
        self.steps += 1
        rec.begin()
        return rec
