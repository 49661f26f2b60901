"""run_ranks: results in rank order, error propagation, timeouts, nothing left behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from moonplan.testing.dist import MARGIN_S, RankError, run_ranks

pytestmark = pytest.mark.distributed


def _gone(pid: int) -> bool:
    """The process is reaped, or a zombie waiting for its (non-reaping) init."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _echo(rank: int, world: int, base: int, *, scale: int = 1) -> tuple:
    t = torch.tensor([rank * scale + base])
    dist.all_reduce(t)
    return rank, world, dist.get_rank(), dist.get_world_size(), int(t), torch.get_num_threads()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_results_in_rank_order(world):
    start = time.monotonic()
    results = run_ranks(_echo, world, 5, scale=10, timeout=20.0)
    assert time.monotonic() - start < 3.0  # ~0.1 s on an idle 2-core machine; slack for load
    total = sum(r * 10 + 5 for r in range(world))
    assert results == [(r, world, r, world, total, 1) for r in range(world)]
    assert mp.active_children() == []


def _raise_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError(f"bad input on rank {rank}")
    dist.barrier()  # the peer is gone: gloo fails this at once


def test_rank_error_lists_type_message_and_traceback():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_raise_on_one, 3, timeout=20.0)
    assert time.monotonic() - start < 10.0
    err = info.value
    assert isinstance(err, RuntimeError)
    one = next(f for f in err.failures if f.rank == 1)
    assert one.type_name == "builtins.ValueError" and one.message == "bad input on rank 1"
    assert "_raise_on_one" in one.traceback
    assert "rank 1: builtins.ValueError: bad input on rank 1" in str(err)
    assert "--- rank 1 traceback ---" in str(err)
    assert mp.active_children() == []


def _sleep_forever(rank: int, world: int, pid_dir: str) -> int:
    if rank == world - 1:
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.path.join(pid_dir, "pids"), "w") as f:
            f.write(f"{os.getpid()} {helper.pid}")
        time.sleep(600)
    return rank


@pytest.mark.slow  # waits for the timeout to expire (about 4 s)
def test_hung_rank_times_out_and_nothing_is_left(tmp_path):
    timeout = 1.0
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 2 of 3 did not finish"):
        run_ranks(_sleep_forever, 3, str(tmp_path), timeout=timeout)
    assert time.monotonic() - start < timeout + MARGIN_S + 5.0  # slack for a loaded machine
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 5.0
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), pids
    assert mp.active_children() == []


def _die(rank: int, world: int) -> None:
    if rank == 0:
        os._exit(3)


def test_dead_rank_is_reported():
    with pytest.raises(RankError, match=r"rank 0: ProcessDied: exited \(code 3\)"):
        run_ranks(_die, 2, timeout=10.0)


def test_unpicklable_result_is_an_error():
    with pytest.raises(RankError, match="rank 0"):
        run_ranks(lambda rank, world: lambda: None, 1, timeout=10.0)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(_echo, 0)


def _rank_and_size(rank: int, world: int) -> tuple[int, int]:
    import torch.distributed as dist_

    return dist_.get_rank(), world


@pytest.mark.slow  # spawned ranks import torch afresh (about 3 s)
def test_spawn_start_method() -> None:
    """Spawned ranks (the default for NCCL, where forked children cannot use CUDA)."""
    assert run_ranks(_rank_and_size, 2, timeout=60, start_method="spawn") == [(0, 2), (1, 2)]


def _flaky_init(tmp_path, fail_runs: int, message: str):
    """An ``init_process_group`` that raises ``message`` on each rank's first ``fail_runs`` calls.

    Forked ranks inherit the patch; each rank counts its own calls in a file.
    """
    real = dist.init_process_group

    def init(*args, rank: int, **kwargs):
        calls = tmp_path / f"calls{rank}"
        n = len(calls.read_text()) if calls.exists() else 0
        calls.write_text("x" * (n + 1))
        if n < fail_runs:
            raise RuntimeError(message)
        return real(*args, rank=rank, **kwargs)

    return init


_GLOO_DROP = "Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [::1]:1"


def test_a_mesh_that_fails_to_connect_is_started_again(tmp_path, monkeypatch):
    """Gloo's transient connect failure: every rank starts again with a fresh store."""
    monkeypatch.setattr(dist, "init_process_group", _flaky_init(tmp_path, 1, _GLOO_DROP))
    with pytest.warns(RuntimeWarning, match=r"attempt 1 of 3.*Connection closed by peer"):
        results = run_ranks(_echo, 2, 5, timeout=20.0)
    assert [r[4] for r in results] == [11, 11]  # (0 + 5) + (1 + 5)
    assert (tmp_path / "calls0").read_text() == "xx"  # one failed run, one that worked


def test_a_mesh_that_never_connects_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(dist, "init_process_group", _flaky_init(tmp_path, 9, _GLOO_DROP))
    with pytest.warns(RuntimeWarning), pytest.raises(RankError, match="Connection closed by peer"):
        run_ranks(_echo, 2, 5, timeout=20.0)
    assert (tmp_path / "calls1").read_text() == "xxx"  # CONNECT_ATTEMPTS runs, then the error


def test_other_init_errors_are_not_retried(tmp_path, monkeypatch):
    monkeypatch.setattr(dist, "init_process_group", _flaky_init(tmp_path, 1, "bad backend"))
    with pytest.raises(RankError, match="bad backend"):
        run_ranks(_echo, 2, 5, timeout=20.0)
    assert (tmp_path / "calls0").read_text() == "x"


def _drop_in_fn(rank: int, world: int) -> None:
    raise RuntimeError(_GLOO_DROP)


def test_a_connect_error_inside_fn_is_not_retried(tmp_path):
    """Once ``fn`` runs, a rerun could repeat its effects: its errors are reported at once."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RankError, match="Connection closed by peer"):
            run_ranks(_drop_in_fn, 2, timeout=20.0)
