"""The profiler: per-phase timing of MoonMoE steps, per rank and on the critical path.

Legend:
    R ranks, L profiled layers, T steps (a layer's ``t``-th forward is its step ``t``)
    span   one timed phase of one step of one layer on one rank: start and end, in
           seconds from the profiler's origin (a barrier at :meth:`Profiler.start`)

Usage (every rank of the EP group runs the same code)::

    with moonplan.profile(model) as prof:      # finds every MoonMoE in model
        for x in batches:
            model(x).sum().backward()
    print(prof.report.table())                  # gathered from every rank at exit

``moonplan.profile`` is :func:`profiling` (also ``layer.profile()`` for one layer).

Phases (:data:`PHASES`): ``counts`` (counts exchange), ``plan``, ``prefetch_exposed``,
``dispatch``, ``experts``, ``combine`` in the forward; ``combine_backward``,
``experts_backward``, ``dispatch_backward``, ``grad_reduce_exposed`` in the backward;
and the :data:`BACKGROUND_PHASES` ``prefetch`` and ``grad_reduce``, measured where
they run (a worker thread, a side stream), which overlap the others and are left
out of step sums and shares (their ``*_exposed`` twins are the critical-path part).
User code may time its own regions with :meth:`Profiler.phase`.

Clocks. On CPU a span is the runtime's own ``time.perf_counter`` readings (the
ones ``StepStats.phases`` is made of), taken relative to an origin read right
after a barrier, so timelines of different ranks (and hosts) line up. With
``aligned=True`` every step (forward and backward) also starts with a barrier,
so that no phase absorbs the wait for a slower rank's earlier work. On CUDA a
span is a pair of ``torch.cuda.Event`` recorded on the current stream (no
synchronisation per phase); they are resolved once, when profiling ends.

Cost when off: every ``LayerRuntime`` holds :data:`NULL_PROFILER`, an immutable
object whose hooks return at once (about a dozen no-op method calls per step). The
runtime declares the hooks it calls (:mod:`moonplan.runtime.step_hooks`); the live
ones, :class:`LayerProfiler` and its :class:`StepRecorder` per step, are this module's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from moonplan.comm.group import EPGroup
from moonplan.profiling.gather import gather_spans
from moonplan.profiling.phases import (
    BACKGROUND_PHASES,
    BACKWARD_PHASES,
    FORWARD_PHASES,
    PHASES,
    USER_LAYER,
)
from moonplan.profiling.report import ProfileReport
from moonplan.runtime.layer_runtime import LayerRuntime
from moonplan.runtime.step_hooks import NULL_PROFILER, NullProfiler

__all__ = [
    "BACKGROUND_PHASES",
    "BACKWARD_PHASES",
    "FORWARD_PHASES",
    "NULL_PROFILER",
    "PHASES",
    "USER_LAYER",
    "LayerProfiler",
    "NullProfiler",
    "ProfileReport",
    "Profiler",
    "StepRecorder",
    "find_runtimes",
    "profile",
    "profiling",
]


class Profiler:
    """Collects the spans of one rank; :meth:`finish` gathers every rank's.

    Args:
        group: the EP group (its device picks the clock: CUDA events or ``perf_counter``).
        aligned: a barrier before every step's forward and backward (CPU and CUDA).
    """

    def __init__(self, group: EPGroup, *, aligned: bool = False):
        self.group, self.aligned = group, aligned
        self.cuda = group.device.type == "cuda"
        self.names: list[str] = list(PHASES)  # local phase ids index this list
        self._ids = {n: i for i, n in enumerate(self.names)}
        self._rows: list[tuple[int, int, int, float, float]] = []  # layer, step, phase, s, s
        self._events: list[tuple[int, int, int, Any, Any]] = []  # same with CUDA events
        self._hooked: list[Any] = []  # LayerRuntime objects we installed hooks on
        self._user_steps: dict[str, int] = {}
        self.origin = 0.0
        self._origin_event: Any = None
        self._report: ProfileReport | None = None
        self._recording = False
        self._traffic = [0, 0]  # records, rows sent by this rank's profiled steps

    # ---- recording ------------------------------------------------------------------------
    def _synchronize(self) -> None:
        """Wait for the device's queued work (CUDA only)."""
        if self.cuda:
            torch.cuda.synchronize(self.group.device)

    def mark(self) -> Any:
        """A boundary: a recorded CUDA event on the current stream, or ``None`` on CPU."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.group.device))
        return ev

    def add(
        self, layer: int, step: int, name: str, times: tuple[float, float], marks: tuple[Any, Any]
    ) -> None:
        """Record a span: host ``times`` (perf_counter s) and boundary ``marks`` (CUDA;
        ``(None, None)`` for a host thread's job, kept on the host clock: both clocks
        start at :meth:`start`, right after a device synchronisation).

        Spans that end after profiling ended (a backward run after the block) are dropped.
        """
        if not self._recording:
            return
        pid = self._ids.get(name)
        if pid is None:
            pid = self._ids[name] = len(self.names)
            self.names.append(name)
        if self.cuda and marks[0] is not None:
            self._events.append((layer, step, pid, *marks))
        else:
            self._rows.append((layer, step, pid, times[0] - self.origin, times[1] - self.origin))

    def add_traffic(self, records: int, rows_sent: int) -> None:
        """Count a profiled step's records and rows sent (rows per record in the report)."""
        if self._recording:
            self._traffic[0] += records
            self._traffic[1] += rows_sent

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a region of user code as phase ``name`` (layer ``USER_LAYER``).

        Its step index counts the regions of that name, so time one per model step.
        """
        step = self._user_steps.get(name, 0)
        self._user_steps[name] = step + 1
        start, t0 = self.mark(), time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.add(USER_LAYER, step, name, (t0, t1), (start, self.mark()))

    # ---- life cycle -----------------------------------------------------------------------
    def start(self, runtimes: Iterable[Any] = ()) -> Profiler:
        """Collective: set the common origin (after a barrier) and hook ``runtimes``.

        Raises:
            RuntimeError: a runtime is already being profiled.
        """
        runtimes = list(runtimes)
        for rt in runtimes:
            if not isinstance(rt.profiler, NullProfiler):
                raise RuntimeError("a MoonMoE layer is already being profiled")
        self.group.barrier()
        self._synchronize()
        self.origin = time.perf_counter()
        self._origin_event = self.mark()
        self._recording = True
        for i, rt in enumerate(runtimes):
            rt.profiler = LayerProfiler(self, i)
            self._hooked.append(rt)
        return self

    def detach(self) -> None:
        """Put the no-op hooks back on every hooked layer (local, no communication)."""
        for rt in self._hooked:
            rt.profiler = NULL_PROFILER
        self._hooked, self._recording = [], False

    def finish(self) -> ProfileReport:
        """Collective: detach, resolve CUDA events, gather every rank's spans.

        Returns:
            The :class:`ProfileReport` (identical on every rank), also kept in :attr:`report`.
        """
        self.detach()
        rows = self._rows + self._resolve_events()
        spans, names = gather_spans(self.group, rows, self.names)
        clock = "cuda events" if self.cuda else "cpu perf_counter"
        mine = torch.tensor(self._traffic, dtype=torch.int64, device=self.group.device)
        records, rows_sent = (int(v) for v in self.group.all_gather(mine).sum(0).tolist())
        self._report = ProfileReport(
            self.group.size, names, spans, clock, self.aligned, (records, rows_sent)
        )
        return self._report

    def _resolve_events(self) -> list[tuple[int, int, int, float, float]]:
        if not self._events:
            return []
        self._synchronize()
        o = self._origin_event
        return [
            (layer, step, pid, o.elapsed_time(a) / 1e3, o.elapsed_time(b) / 1e3)
            for layer, step, pid, a, b in self._events
        ]

    @property
    def report(self) -> ProfileReport:
        """The gathered report (after :meth:`finish`, i.e. after the ``profiling`` block)."""
        if self._report is None:
            raise RuntimeError("the profile is gathered when profiling ends (Profiler.finish)")
        return self._report


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


def find_runtimes(layers_or_model: Any) -> list[Any]:
    """Every MoonMoE runtime in a module (``modules()`` order), a layer, or an iterable of them."""
    if isinstance(layers_or_model, torch.nn.Module):
        modules: Iterable[Any] = layers_or_model.modules()
    else:
        modules = (m for item in layers_or_model for m in _modules_of(item))
    found: list[Any] = []
    for m in modules:
        rt = getattr(m, "runtime", None)
        if isinstance(rt, LayerRuntime) and all(rt is not f for f in found):
            found.append(rt)
    return found


def _modules_of(item: Any) -> Iterable[Any]:
    return item.modules() if isinstance(item, torch.nn.Module) else (item,)


@contextmanager
def profiling(layers_or_model: Any, *, aligned: bool = False) -> Iterator[Profiler]:
    """Collective context manager: profile every MoonMoE layer found in ``layers_or_model``.

    Args:
        layers_or_model: an ``nn.Module`` (searched with ``modules()``), or an iterable
            of modules; layers are numbered in the order found (the trace's ``tid``).
        aligned: a barrier before each step's forward and backward (see module docs).

    Yields:
        The :class:`Profiler`; its :attr:`~Profiler.report` is set when the block ends
        normally (a collective gather: every rank must leave the block). If the block
        raises, the hooks are removed without communicating and nothing is gathered.

    Raises:
        ValueError: no MoonMoE layer was found, or the layers' groups differ in size.
    """
    runtimes = find_runtimes(layers_or_model)
    if not runtimes:
        raise ValueError("profiling found no MoonMoE layer to profile")
    group = runtimes[0].group
    if any(rt.group.size != group.size for rt in runtimes):
        raise ValueError("profiling needs every MoonMoE layer on EP groups of the same size")
    prof = Profiler(group, aligned=aligned).start(runtimes)
    try:
        yield prof
    except BaseException:
        prof.detach()
        raise
    prof.finish()


profile = profiling
"""``moonplan.profile``: the same context manager as :func:`profiling`
(``with moonplan.profile(model) as prof: ...``)."""
