"""Run a per-rank function on the ranks the CLI starts, or on those a launcher started.

``moonplan demo`` and ``moonplan profile`` start their own processes
(:func:`moonplan.testing.dist.run_ranks`: fork, one host). Under ``torchrun`` (or any
launcher that sets ``WORLD_SIZE``/``RANK``/``MASTER_ADDR``, also across hosts), or when
the caller already initialised ``torch.distributed``, they instead run in the launched
processes on its default group: :func:`run_on_ranks` picks the way.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def launched() -> bool:
    """Whether this process is one rank of a launched job (a process group exists or
    ``WORLD_SIZE`` is set, as ``torchrun`` does)."""
    return (dist.is_available() and dist.is_initialized()) or "WORLD_SIZE" in os.environ


def launched_world_size() -> int:
    """``R`` of the launched job (the initialised group's, else ``WORLD_SIZE``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"])


def resolve_world_size(requested: int | None, default: int) -> int:
    """The EP size to run: the launched job's (``requested`` must be ``None`` or equal),
    else ``requested``, else ``default``.

    Raises:
        ValueError: ``requested`` differs from the launched job's size.
    """
    if not launched():
        return default if requested is None else requested
    R = launched_world_size()
    if requested is not None and requested != R:
        raise ValueError(f"--ep {requested} differs from the launched job's {R} ranks")
    return R


def ensure_group(backend: str) -> bool:
    """Initialise the default group from the launcher's environment unless one exists;
    returns whether this call created it (then the caller destroys it)."""
    if dist.is_initialized():
        return False
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return True


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float,
    backend: str,
) -> list[Any] | None:
    """``fn(rank, R, *args)`` on every rank; the results in rank order on the reporting rank.

    Launched (see :func:`launched`): runs ``fn`` in this process on the default group
    (initialised here from the environment if needed), gathers the results on rank 0 and
    returns them there, ``None`` on the other ranks (``world_size`` must be the launched
    size: see :func:`resolve_world_size`). Otherwise starts ``world_size`` processes on
    this host and returns every result (the caller reports).
    """
    if not launched():
        from moonplan.testing.dist import run_ranks

        return run_ranks(fn, world_size, *args, timeout=timeout, backend=backend)
    R = resolve_world_size(world_size, world_size)
    created = ensure_group(backend)
    try:
        rank = dist.get_rank()
        out = fn(rank, R, *args)
        got: list[Any] | None = [None] * R if rank == 0 else None
        dist.gather_object(out, got, dst=0)
        # Layers left in reference cycles (routers closing over their layer) hold heaps
        # whose release may talk to the group: release them now, while it still exists,
        # and let every rank get here before any tears the group down.
        gc.collect()
        dist.barrier()
        return got
    finally:
        if created:
            dist.destroy_process_group()


def run_and_announce(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    command: str,
    what: str,
    device: str,
    timeout: float,
) -> list[Any] | None:
    """:func:`run_on_ranks` on ``nccl`` for ``device == "cuda"``, else ``gloo``, after the
    reporting rank prints ``{command}: {R} ranks ({backend}), {what}``.

    The launch preamble of ``moonplan demo`` and ``moonplan profile``; returns what
    :func:`run_on_ranks` returns (``None`` on a launched rank other than 0).
    """
    backend = "nccl" if device == "cuda" else "gloo"
    if is_reporting_rank():
        print(f"{command}: {world_size} ranks ({backend}), {what}", flush=True)
    return run_on_ranks(fn, world_size, *args, timeout=timeout, backend=backend)


def is_reporting_rank() -> bool:
    """True where results are printed: rank 0 of a launched job, or a process that is not
    one (it starts the ranks itself)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0
