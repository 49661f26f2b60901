"""Heap files name their creator; files of dead creators are removed, nothing else is.
SIGKILL of every rank while the heap is created, then a new job: nothing stays."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time

import pytest

from moonplan.comm import EPGroup, create_heap
from moonplan.comm.shm_files import (
    SHM_DIR,
    Owner,
    is_alive,
    parse_name,
    remove_stale_files,
    shm_path,
    this_process,
)
from tests.comm.killable import join_group, killable_ranks

TIMEOUT = 30.0


def _dead_pid() -> int:
    ctx = mp.get_context("fork")
    p = ctx.Process(target=lambda: None)
    p.start()
    p.join(TIMEOUT)
    assert p.pid is not None
    return p.pid


def test_names_round_trip_and_liveness():
    me = this_process()
    path = shm_path("00ff", 3, me, "/x")
    assert path == f"/x/moonplan-00ff-r3-{me.tag()}"
    assert parse_name(os.path.basename(path)) == ("00ff", 3, me)
    assert Owner.from_tag(me.tag()) == me
    assert parse_name("moonplan-00ff-r3") is None
    with pytest.raises(ValueError):
        Owner.from_tag("p1-s2")
    assert is_alive(me)
    assert not is_alive(Owner(me.pid, me.start + 1, me.ns))  # a reused pid is not the creator
    assert not is_alive(Owner(_dead_pid(), me.start, me.ns))


def test_only_files_of_dead_creators_are_removed():
    me = this_process()
    dead = Owner(_dead_pid(), 1, me.ns)
    with tempfile.TemporaryDirectory() as d:
        files = {
            "dead": shm_path("aa", 0, dead, d),
            "reused": shm_path("aa", 1, Owner(me.pid, me.start + 7, me.ns), d),
            "live": shm_path("bb", 0, me, d),
            "other-ns": shm_path("cc", 0, Owner(dead.pid, 1, me.ns + 1), d),
            "old-name": os.path.join(d, "moonplan-dd-r0"),
            "not-ours": os.path.join(d, "other-file"),
        }
        for path in files.values():
            open(path, "wb").close()
        out = remove_stale_files(d)
        left = set(os.listdir(d))
        assert sorted(out.removed) == sorted(os.path.basename(files[k]) for k in ("dead", "reused"))
        assert left == {
            os.path.basename(files[k]) for k in ("live", "other-ns", "old-name", "not-ours")
        }
        assert "running" in out.kept[os.path.basename(files["live"])]
        assert "namespace" in out.kept[os.path.basename(files["other-ns"])]
        assert remove_stale_files(os.path.join(d, "missing")).removed == []


def _stall_in_creation(rank: int, world: int, store: str, queue) -> None:
    """Create a heap, but stop (forever) while the files are in /dev/shm."""
    import moonplan.comm.shm_heap as shm_heap

    join_group(rank, world, store)
    real = shm_heap._open_peers

    def stall(paths, r, fd):
        fds = real(paths, r, fd)
        queue.put(os.getpid())
        time.sleep(120)
        return fds

    shm_heap._open_peers = stall
    create_heap(EPGroup(), 1 << 20, backend="shm")


def _files_of(pids: set[int]) -> list[str]:
    names = [(n, parse_name(n)) for n in os.listdir(SHM_DIR)]
    return sorted(n for n, p in names if p is not None and p[2].pid in pids)


@pytest.mark.distributed
def test_sigkill_during_creation_then_a_new_job_cleans_up():
    with killable_ranks(_stall_in_creation, 2, TIMEOUT) as (procs, got):
        pids = set(got)
        assert len(_files_of(pids)) == 2  # inside the window: both files exist
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
        for p in procs:
            p.join(TIMEOUT)
            assert p.exitcode == -signal.SIGKILL
        left = _files_of(pids)
        assert len(left) == 2 and all(os.path.getsize(f"{SHM_DIR}/{n}") == 0 for n in left)
        heap = create_heap(EPGroup(), 4096, backend="shm")  # the next job
        heap.close()
        assert _files_of(pids) == []


def test_doctor_command_removes_stale_files(capsys: pytest.CaptureFixture[str]):
    from moonplan.cli.main import main

    me = this_process()
    with tempfile.TemporaryDirectory() as d:
        stale = shm_path("ee", 0, Owner(_dead_pid(), 1, me.ns), d)
        live = shm_path("ee", 1, me, d)
        for path in (stale, live):
            open(path, "wb").close()
        assert main(["doctor", "--dir", d, "--dry-run"]) == 0
        assert "would remove 1 stale file(s), kept 1" in capsys.readouterr().out
        assert os.path.exists(stale)
        assert main(["doctor", "--dir", d]) == 0
        out = capsys.readouterr().out
        assert f"removed {stale}" in out and f"kept {live}: creator pid {me.pid} is running" in out
        assert os.listdir(d) == [os.path.basename(live)]
