"""BackgroundLane: where a runtime's prefetch and reduce run (thread, inline; CUDA skips)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moonplan.runtime.background import BackgroundLane, lane_kind


def test_thread_lane_runs_beside_the_caller_and_returns_the_result() -> None:
    lane = BackgroundLane("thread", torch.device("cpu"))
    started = threading.Event()
    release = threading.Event()

    def job() -> str:
        started.set()
        release.wait(5)
        return threading.current_thread().name

    pending = lane.submit(job)
    assert started.wait(5)  # running while the caller goes on
    assert not pending.done
    release.set()
    name = pending.wait()
    assert name.startswith("moonplan-bg") and name != threading.current_thread().name
    assert pending.done and pending.wait() == name  # a second wait returns the same
    assert pending.run_s >= 0 and pending.waited_s >= 0
    lane.close()


def test_waited_time_is_what_the_caller_blocked() -> None:
    lane = BackgroundLane("thread", torch.device("cpu"))
    pending = lane.submit(lambda: time.sleep(0.15))
    pending.wait()
    assert pending.run_s >= 0.15 and 0.05 <= pending.waited_s <= pending.run_s + 0.05
    hidden = lane.submit(lambda: time.sleep(0.05))
    time.sleep(0.2)  # the caller's own work covers the job
    hidden.wait()
    assert hidden.run_s >= 0.05 and hidden.waited_s < 0.03
    lane.close()


def test_errors_surface_at_wait_and_drain_forgets_them() -> None:
    lane = BackgroundLane("thread", torch.device("cpu"))

    def boom() -> None:
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        lane.submit(boom).wait()
    lane.submit(boom)
    lane.drain()  # a failed step's job: waited for, error dropped
    assert lane.submit(lambda: 3).wait() == 3
    lane.close()


def test_jobs_run_in_order_one_at_a_time() -> None:
    lane = BackgroundLane("thread", torch.device("cpu"))
    seen: list[int] = []
    first = lane.submit(lambda: (time.sleep(0.05), seen.append(1)))
    second = lane.submit(lambda: seen.append(2))  # waits for the first
    assert first.done
    second.wait()
    assert seen == [1, 2]
    lane.close()


def test_close_joins_the_worker_and_the_lane_can_restart() -> None:
    before = set(threading.enumerate())  # other tests' layers may keep their own lanes
    lane = BackgroundLane("thread", torch.device("cpu"))
    lane.submit(lambda: None).wait()
    new = set(threading.enumerate()) - before
    workers = [t for t in new if t.name.startswith("moonplan-bg")]
    assert workers
    lane.close()
    assert all(not t.is_alive() for t in workers)
    assert lane.submit(lambda: 5).wait() == 5
    lane.close()


def test_inline_lane_runs_at_submit_and_counts_all_as_waited() -> None:
    lane = BackgroundLane("inline", torch.device("cpu"))
    seen: list[str] = []
    pending = lane.submit(lambda: (time.sleep(0.02), seen.append("ran"))[1])
    assert seen == ["ran"] and pending.done
    assert pending.waited_s == pending.run_s >= 0.02


def test_lane_kind_and_bad_arguments() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert lane_kind(True, cpu, True) == "thread"
    assert lane_kind(True, cuda, True) == "stream"
    assert lane_kind(False, cpu, True) == lane_kind(True, cpu, False) == "inline"
    with pytest.raises(ValueError, match="kind"):
        BackgroundLane("process", cpu)
    with pytest.raises(ValueError, match="CUDA"):
        BackgroundLane("stream", cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stream_lane_orders_the_current_stream_after_the_job() -> None:
    dev = torch.device("cuda", 0)
    lane = BackgroundLane("stream", dev)
    a = torch.randn(1 << 20, device=dev)
    pending = lane.submit(lambda: a * 2)
    b = pending.wait()  # the current stream waits for the side stream's event
    torch.testing.assert_close(b, a * 2)
    assert pending.events is not None
    lane.close()
