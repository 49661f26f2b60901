"""``run_ranks``: run a function on ``R`` real ``torch.distributed`` ranks (forked processes).

Each rank is a process started with the multiprocessing ``fork`` context (so it
works from pytest, after ``import torch``, with lambdas and closures). It joins a
process group (gloo by default) through a ``FileStore`` in a private temporary
directory, runs ``fn(rank, world_size, *args, **kwargs)``, destroys the group and
sends back its pickled return value (or its exception) through a pipe.

The parent waits at most ``timeout`` plus a small margin; ranks still running then
are killed (their whole process group, so helpers they started die too). No
process and no store file is left behind, whatever happens.

Gloo's TCP mesh sometimes fails to connect on a loaded machine ("Connection closed
by peer" inside ``init_process_group``, before ``fn`` runs; torch's own gloo tests
see it too). A run whose only failures are such connection errors is started again
with a fresh store, at most ``CONNECT_ATTEMPTS`` times in all, with a warning each
time; any other failure is reported at once.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

MARGIN_S = 3.0  # the parent waits timeout + MARGIN_S before it kills hung ranks
GRACE_S = 5.0  # after a rank fails, how long the others get to finish before they are killed
CONNECT_ATTEMPTS = 3  # runs in all when the only failures are gloo's mesh failing to connect
# what gloo's TCP transport raises when a mesh fails to connect (a transient, not a bug)
_CONNECT_ERRORS = ("connectFullMesh", "Connection closed by peer", "Connection reset by peer")
INIT, FN = "init", "fn"  # RankFailure.phase: inside init_process_group, or inside fn


@dataclass(frozen=True)
class RankFailure:
    """What one rank raised: exception type (qualified name), message, traceback text."""

    rank: int
    type_name: str
    message: str
    traceback: str
    phase: str = FN  # INIT: raised inside init_process_group, before fn ran on this rank

    @property
    def transient(self) -> bool:
        """Gloo's mesh failed to connect: a fresh run may succeed."""
        return self.phase == INIT and any(e in self.message for e in _CONNECT_ERRORS)


class RankError(RuntimeError):
    """One or more ranks raised; lists each failing rank's exception and traceback.

    Attributes:
        failures: one :class:`RankFailure` per failing rank, ascending rank.
        killed: ranks still running after the others failed (killed, no result).
    """

    def __init__(self, failures: list[RankFailure], killed: list[int] | None = None):
        self.failures = sorted(failures, key=lambda f: f.rank)
        self.killed = sorted(killed or [])
        super().__init__(_describe(self.failures, self.killed))


def _describe(failures: list[RankFailure], killed: list[int]) -> str:
    ranks = ", ".join(str(f.rank) for f in failures)
    lines = [f"rank {ranks} failed:"]
    lines += [f"  rank {f.rank}: {f.type_name}: {f.message}" for f in failures]
    if killed:
        lines.append(
            f"  rank {', '.join(map(str, killed))}: still running {GRACE_S:g} s "
            "after the first failure; killed"
        )
    for f in failures:
        lines.append(f"--- rank {f.rank} traceback ---\n{f.traceback.rstrip()}")
    return "\n".join(lines)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    backend: str = "gloo",
    start_method: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` new processes.

    Args:
        fn: the per-rank function; its return value must be picklable.
        world_size: ``R >= 1``.
        timeout: seconds; the process-group timeout of every collective, and (plus
            ``MARGIN_S``) the bound on the whole run.
        backend: ``torch.distributed`` backend (``"gloo"`` on CPU).
        start_method: ``"fork"`` (fast; the default for gloo) or ``"spawn"`` (the
            default for nccl: CUDA cannot be used in a child forked from a parent
            that touched it). With spawn, ``fn`` must be importable by name.

    Returns:
        The per-rank return values, in rank order.

    Raises:
        RankError: a rank raised (or died); lists each failing rank. A run whose
            only failures are gloo's mesh failing to connect is first started again
            (``CONNECT_ATTEMPTS`` runs in all, a ``RuntimeWarning`` each time).
        TimeoutError: ranks did not finish in time; names them (they are killed).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("run_ranks needs a parent process without a default process group")
    method = start_method or ("spawn" if backend == "nccl" else "fork")
    ctx = mp.get_context(method)
    for attempt in range(1, CONNECT_ATTEMPTS + 1):
        try:
            return _run_once(ctx, fn, world_size, args, kwargs, timeout, backend)
        except RankError as err:
            if attempt == CONNECT_ATTEMPTS or not all(f.transient for f in err.failures):
                raise
            warnings.warn(
                f"run_ranks: gloo's mesh failed to connect (attempt {attempt} of "
                f"{CONNECT_ATTEMPTS}); starting every rank again with a fresh store: "
                f"{err.failures[0].message}",
                RuntimeWarning,
                stacklevel=2,
            )
    raise AssertionError("unreachable")  # the last attempt returns or raises


def _run_once(
    ctx: Any,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    backend: str,
) -> list[Any]:
    """One run of every rank, with its own store; nothing is left behind."""
    with tempfile.TemporaryDirectory(prefix="moonplan-dist-") as tmp:
        spec = _Spec(fn, world_size, args, kwargs, timeout, backend, os.path.join(tmp, "store"))
        procs: list[Any] = []
        conns: list[Connection] = []
        try:
            for rank in range(world_size):
                proc, conn = _start(ctx, spec, rank)
                procs.append(proc)
                conns.append(conn)
            reports, hung = _collect(conns, time.monotonic() + timeout + MARGIN_S)
        finally:
            _reap(procs, conns)
    return _results(reports, hung, procs, timeout)


@dataclass(frozen=True)
class _Spec:
    fn: Callable[..., Any]
    world_size: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    timeout: float
    backend: str
    store_path: str


def _start(ctx: Any, spec: _Spec, rank: int) -> tuple[Any, Connection]:
    recv_end, send_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(spec, rank, send_end))
    proc.start()
    send_end.close()  # the child holds the only writer: EOF when it exits
    return proc, recv_end


def _child_main(spec: _Spec, rank: int, conn: Connection) -> None:
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # own process group: the parent can kill helpers it starts
    torch.set_num_threads(1)
    payload = _run_rank(spec, rank)
    try:
        conn.send_bytes(payload)
    finally:
        conn.close()


def _run_rank(spec: _Spec, rank: int) -> bytes:
    phase = INIT
    try:
        if spec.backend == "nccl":  # one GPU per rank, as torchrun's LOCAL_RANK would give
            os.environ["LOCAL_RANK"] = str(rank)
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(spec.store_path, spec.world_size)
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.timeout),
        )
        phase = FN
        try:
            result = spec.fn(rank, spec.world_size, *spec.args, **spec.kwargs)
        finally:
            dist.destroy_process_group()
        return pickle.dumps(("ok", result))
    except BaseException as exc:  # report everything, including SystemExit
        kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        return pickle.dumps(("err", kind, str(exc), traceback.format_exc(), phase))


def _collect(conns: list[Connection], deadline: float) -> tuple[dict[int, tuple], list[int]]:
    """Reports by rank, and the ranks that had not reported when time ran out."""
    reports: dict[int, tuple] = {}
    pending = {conn: rank for rank, conn in enumerate(conns)}
    limit = deadline
    while pending:
        left = limit - time.monotonic()
        if left <= 0:
            break
        for conn in wait(list(pending), timeout=left):
            rank = pending.pop(conn)  # type: ignore[call-overload]
            reports[rank] = _receive(conn)
            if reports[rank][0] != "ok":
                limit = min(limit, time.monotonic() + GRACE_S)
    return reports, sorted(pending.values())


def _receive(conn: Any) -> tuple:
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return ("died",)


def _reap(procs: list[Any], conns: list[Connection]) -> None:
    """Kill whatever still runs (process groups included) and join every process."""
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    for proc in procs:
        proc.join()
    for conn in conns:
        conn.close()


def _results(
    reports: dict[int, tuple], hung: list[int], procs: list[Any], timeout: float
) -> list[Any]:
    failures = [
        _failure(rank, report, procs[rank].exitcode)
        for rank, report in sorted(reports.items())
        if report[0] != "ok"
    ]
    if failures:
        raise RankError(failures, hung)
    if hung:
        raise TimeoutError(
            f"rank {', '.join(map(str, hung))} of {len(procs)} did not finish within "
            f"timeout={timeout:g} s (+{MARGIN_S:g} s margin); killed"
        )
    return [reports[rank][1] for rank in range(len(procs))]


def _failure(rank: int, report: tuple, exitcode: int | None) -> RankFailure:
    if report[0] == "died":
        how = f"killed by signal {-exitcode}" if exitcode and exitcode < 0 else f"code {exitcode}"
        return RankFailure(rank, "ProcessDied", f"exited ({how}) without a result", "")
    _, kind, message, text, phase = report
    return RankFailure(rank, kind, message, text, phase)
