"""Ranks the shm tests kill on purpose: forked processes outside ``run_ranks``.

Legend: R ranks (forked processes).

:func:`killable_ranks` starts ``R`` processes running
``target(rank, R, store_path, queue)``, waits for one message from each (the
target puts it once it reached the state under test), yields the processes and
the messages, and kills and joins every process on the way out, whatever happened.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import tempfile
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist


def join_group(rank: int, world: int, store: str) -> None:
    """Join a gloo group of ``world`` ranks through the file store at ``store`` (one thread)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)


@contextlib.contextmanager
def killable_ranks(
    target: Callable[..., None], world: int, timeout: float
) -> Iterator[tuple[list[BaseProcess], list[Any]]]:
    """``(processes, first message of each)``; every process is killed on exit."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=target, args=(r, world, store, queue)) for r in range(world)]
        try:
            for p in procs:
                p.start()
            yield procs, [queue.get(timeout=timeout) for _ in procs]
        finally:
            for p in procs:
                p.kill()
                p.join()
