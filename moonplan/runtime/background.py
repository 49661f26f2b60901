"""Background work of one layer runtime: the weight prefetch and the replica-gradient
reduce.

Legend: none (no tensors of their own: a job returns whatever its function returns).

A :class:`BackgroundLane` runs a job beside the caller's work and hands back a
:class:`Pending`; ``Pending.wait()`` returns the job's result once it is done. Three
kinds, picked by the runtime from its transport (``Transport.one_sided``) and device
(never at import time):

* ``"thread"`` (CPU): one worker thread per lane, created on the first job and
  joined by :meth:`BackgroundLane.close`. On the shared-memory heap the jobs are
  plain peer-memory copies (torch releases the GIL while copying). On the all-to-all
  transports the prefetch and the replica-gradient reduce are collectives: the
  worker issues them on the layer's second process group
  (:meth:`~moonplan.comm.group.EPGroup.background_group`), never on the group the
  caller's dispatch uses, so each process group sees its collectives in the same
  order on every rank (a job is started, or not, from all-gathered data).
* ``"stream"`` (CUDA heap): the job is enqueued on a side stream that first waits
  for the current stream; ``wait()`` makes the current stream wait for an event
  recorded after the job (no host synchronisation).
* ``"inline"`` (the serial schedule; the all-to-all transports on CUDA): the job
  runs at once in the caller. On CUDA the all-to-all prefetch stays inline for
  now: two NCCL communicators used from two threads must issue their collectives
  in the same order on every rank, and that path has never run on a GPU
  (:func:`collectives_in_thread`).

Times: ``Pending.run_s`` is the job's own duration (measured in the worker on CPU,
host enqueue time on CUDA, where ``events`` hold the side-stream start and end);
``Pending.waited_s`` is how long ``wait()`` blocked the caller. Inline jobs run on
the critical path, so there ``waited_s == run_s``.

Failures: a job's exception is raised by the ``wait()`` of the step that started
it. A collective job (all-to-all, ``"thread"``) that fails on one rank before its
collectives leaves the other ranks' workers waiting in the background group; they
raise when that group's collective timeout expires (the same as the main group's:
:meth:`~moonplan.comm.group.EPGroup.background_group` copies it), exactly as a
rank failing in a serial collective leaves its peers waiting in the main group. A
failure inside ``gather_rows``'s own validation is agreed by its first all-to-all
and raised on every rank at once. No collective is added per step for this.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

KINDS = ("thread", "stream", "inline")


class Pending:
    """A job started by :meth:`BackgroundLane.submit`; :meth:`wait` once for its result."""

    def __init__(
        self,
        future: Future | None = None,
        result: Any = None,
        span: tuple[float, float] | None = None,
    ):
        self._future, self._result = future, result
        if span is None:
            now = time.perf_counter()
            span = (now, now)
        self.span = span  # perf_counter start and end of the job (host)
        self.waited_s = self.run_s if future is None else 0.0
        self.events: tuple[Any, Any] | None = None  # CUDA start/end on the side stream
        self._ready: Any = None  # CUDA event the current stream waits for
        self._done = future is None

    @property
    def run_s(self) -> float:
        """Seconds the job ran (host clock)."""
        return self.span[1] - self.span[0]

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has returned (or the job ran inline)."""
        return self._done

    def finished(self) -> bool:
        """Whether the job has ended (then :meth:`wait` returns at once); never blocks: the
        worker's future (``"thread"``), the side stream's end event (``"stream"``)."""
        if self._done:
            return True
        if self._future is not None:
            return self._future.done()
        return self._ready is None or bool(self._ready.query())

    def wait(self) -> Any:
        """The job's result; blocks (CPU) or orders the current stream (CUDA) until done.

        Raises whatever the job raised (on CPU, in the worker thread).
        """
        if self._done:
            return self._result
        t0 = time.perf_counter()
        if self._future is not None:
            self._result, self.span = self._future.result()
        if self._ready is not None:
            stream = torch.cuda.current_stream(self._ready.device)
            stream.wait_event(self._ready)
            _record_stream(self._result, stream)
        self.waited_s = time.perf_counter() - t0
        self._done = True
        return self._result


class BackgroundLane:
    """Runs jobs beside the caller (see the module docstring for the three kinds).

    Args:
        kind: ``"thread"``, ``"stream"`` or ``"inline"``.
        device: the runtime's device (the side stream's, for ``"stream"``).
        name: the worker thread's name prefix (``"thread"``).
    """

    def __init__(self, kind: str, device: torch.device, *, name: str = "moonplan-bg"):
        if kind not in KINDS:
            raise ValueError(f"background lane kind must be one of {KINDS}, got {kind!r}")
        if kind == "stream" and device.type != "cuda":
            raise ValueError(f"a 'stream' lane needs a CUDA device, got {device}")
        self.kind, self.device, self.name = kind, device, name
        self._pool: ThreadPoolExecutor | None = None
        self._stream: Any = None
        self._last: Pending | None = None

    def submit(self, fn: Callable[[], Any], *, step: bool = True) -> Pending:
        """Start ``fn()`` in the background. A step's job (``step=True``): at most one is
        outstanding (the previous one is waited for first) and :meth:`drain` waits for it.
        ``step=False``: a job that may outlive the steps (a refill,
        :mod:`moonplan.runtime.refill`); :meth:`drain` does not wait for it, its owner
        does (:meth:`close` too, on a worker thread). Jobs run in submission order either
        way (one worker, one side stream), so a step's job started after it waits for it.
        """
        if step:
            self.drain()
        if self.kind == "inline":
            t0 = time.perf_counter()
            result = fn()
            pending = Pending(result=result, span=(t0, time.perf_counter()))
        elif self.kind == "thread":
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
            pending = Pending(self._pool.submit(_timed, fn))
        else:
            pending = self._submit_stream(fn)
        if step:
            self._last = pending
        return pending

    def _submit_stream(self, fn: Callable[[], Any]) -> Pending:
        current = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(current)  # inputs written on the current stream are ready
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        t0 = time.perf_counter()
        with torch.cuda.stream(self._stream):
            start.record(self._stream)
            result = fn()
            end.record(self._stream)
        pending = Pending(result=result, span=(t0, time.perf_counter()))
        pending._done, pending.waited_s = False, 0.0
        pending._ready, pending.events = end, (start, end)
        return pending

    def drain(self) -> None:
        """Wait for the outstanding job, if any (its errors are dropped: the step that
        started it has already failed). Call before anything the job reads or writes is
        freed or rewritten outside a step (buffer growth, closing)."""
        last, self._last = self._last, None
        if last is not None and not last.done:
            with contextlib.suppress(Exception):  # its step raised already: clean-up only
                last.wait()

    def close(self) -> None:
        """Drain and join the worker thread (the lane can be used again afterwards)."""
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _timed(fn: Callable[[], Any]) -> tuple[Any, tuple[float, float]]:
    t0 = time.perf_counter()
    out = fn()
    return out, (t0, time.perf_counter())


def collectives_in_thread(device: torch.device) -> bool:
    """Whether a worker thread may issue collectives on a second process group while the
    caller issues its own on the first, for tensors on ``device``.

    True on the CPU (gloo: every process group has its own connections; tested on 2 to
    4 ranks, ``tests/runtime/test_overlap_a2a.py``). False on CUDA: NCCL would need the
    two communicators' kernels ordered alike on every rank, and this has not run on a
    GPU, so the all-to-all prefetch stays inline there (serial schedule).
    """
    return device.type != "cuda"


def lane_kind(
    one_sided: bool, device: torch.device, overlap: bool, *, second_group: bool = False
) -> str:
    """The lane a runtime uses.

    ``"inline"`` with the serial schedule (``overlap=False``). A ``one_sided`` transport
    (heap: ``fetch_rows`` is peer reads) gets ``"stream"`` on CUDA and ``"thread"``
    elsewhere. A collective transport (all-to-all) gets ``"thread"`` only where
    ``second_group`` (the runtime holds a background process group for the worker's
    collectives) and :func:`collectives_in_thread` allows it; else ``"inline"``
    (on CUDA for now: the serial schedule).
    """
    if not overlap:
        return "inline"
    if one_sided:
        return "stream" if device.type == "cuda" else "thread"
    return "thread" if second_group and collectives_in_thread(device) else "inline"


def _record_stream(result: Any, stream: Any) -> None:
    """Tell the caching allocator that ``result``'s tensors are used on ``stream`` too."""
    if isinstance(result, torch.Tensor):
        if result.is_cuda:
            result.record_stream(stream)
    elif isinstance(result, dict):
        for v in result.values():
            _record_stream(v, stream)
    elif isinstance(result, (tuple, list)):
        for v in result:
            _record_stream(v, stream)
