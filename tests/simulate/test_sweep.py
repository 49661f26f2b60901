"""Sweeps, break-even, trends, tables and the progress bar (small and fast)."""

from __future__ import annotations

import io
import math

import pytest

from moonplan.baselines import POLICY_NAMES
from moonplan.simulate.progress import ProgressBar
from moonplan.simulate.report import break_even_table, detail_table, sweep_table, trend_table
from moonplan.simulate.sweep import SweepSpec, _first_win, break_even, simulate_trace, sweep
from moonplan.simulate.trends import deepspeed_trend, gshard_trend
from moonplan.simulate.workload import drifting_counts

SMALL = SweepSpec(model="mixtral-8x7b", ranks=(2, 4), sigmas=(0.0, 1.5), tokens=64, steps=2,
                  warmup=2, eplb_period=2, eplb_window=2)  # fmt: skip


def test_sweep_rows_cover_every_point_and_policy() -> None:
    calls: list[tuple[int, int]] = []
    rows = sweep(SMALL, progress=lambda d, t, _: calls.append((d, t)))
    assert len(rows) == 2 * 2 * len(POLICY_NAMES)
    assert calls[0] == (0, 4) and calls[-1] == (4, 4)
    for r in rows:
        assert math.isfinite(r["rel_ideal"]) and r["rel_ideal"] > 0
        assert r["ranks"] in (2, 4) and r["sigma"] in (0.0, 1.5)
        if r["policy"].startswith("moon"):
            assert r["dropped"] == 0
        if r["policy"] in ("moonep-greedy", "moonplan", "moonplan-resident"):
            assert r["balancedness"] == pytest.approx(1.0)
        if r["policy"] == "moonplan-auto":  # the candidate it took in each measured step
            assert sum(r["choices"].values()) == SMALL.steps
    table = sweep_table(rows)
    assert "resident" in table and "auto" in table and "sigma 1.5" in table
    assert sweep_table(rows, markdown=True).startswith("| EP |")
    assert "moonplan-resident" in detail_table(rows)


def test_maxvio_targets_become_sigmas() -> None:
    spec = SweepSpec(model="mixtral-8x7b", ranks=(2,), maxvios=(0.5,), tokens=64, steps=1,
                     warmup=1, policies=("static-linear",))  # fmt: skip
    rows = sweep(spec)
    assert rows[0]["maxvio_target"] == 0.5 and rows[0]["sigma"] > 0
    assert "maxvio 0.5" in sweep_table(rows)


def test_simulate_trace_checks_its_input() -> None:
    from moonplan.simulate import get_hardware, get_model
    from moonplan.simulate.model_time import SimConfig

    counts = drifting_counts(2, 8, 16, 2, sigma=0.0, steps=2)
    model, hw = get_model("mixtral-8x7b"), get_hardware("h200-node")
    with pytest.raises(ValueError, match="warmup"):
        simulate_trace(counts, model, hw, SimConfig(), warmup=2)
    with pytest.raises(ValueError, match="experts"):
        simulate_trace(counts[:, :, :4], model, hw, SimConfig())


def test_break_even() -> None:
    spec = SweepSpec(steps=1, warmup=1)
    res = break_even("mixtral-8x7b", "h200-node", 4, 1.0, tokens=(64, 8192), spec=spec)
    assert res["tokens"] == [64, 8192] and set(res["break_even"]) == {
        "moonplan",
        "moonplan-resident",
        "moonplan-auto",
    }
    assert all(len(v) == 2 for v in res["ratio"].values())
    assert "mixtral-8x7b" in break_even_table([res])
    assert _first_win([1, 2, 4, 8], [1.2, 0.9, 1.1, 0.8]) == 8
    assert _first_win([1, 2, 4, 8], [0.5, 0.9, 1.0, 0.8]) == 1
    assert _first_win([1, 2], [0.5, 1.5]) is None


def test_deepspeed_trend_is_super_linear_per_gpu() -> None:
    rows = deepspeed_trend(gpus=(8, 64), tokens=64)
    assert [r["experts_per_gpu"] for r in rows] == [16, 2]
    assert rows[0]["per_gpu_speedup"] == 1.0 and rows[1]["per_gpu_speedup"] > 1.0


def test_gshard_share_of_dispatch_and_combine_grows_with_experts() -> None:
    rows = gshard_trend(experts=(128, 1024), tokens=64)
    assert rows[1]["share"] > rows[0]["share"] > 0
    assert "share" in trend_table(rows, ["experts", "share"])


def test_progress_plain_lines_with_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr("moonplan.simulate.progress.time.monotonic", lambda: now[0])
    out = io.StringIO()  # not a terminal: one plain line per call
    bar = ProgressBar(out, description="sweep")
    now[0] = 2.0
    bar(1, 4, "first")  # 2 s for 1 of 4: 6 s left
    now[0] = 4.0
    bar(4, 4, "done")
    bar(0, 2, "again")  # a new sequence restarts the clock
    now[0] = 5.0
    bar(0, 2, "still")
    lines = out.getvalue().splitlines()
    assert lines[0] == "sweep [1/4] elapsed 2.0s, ETA 6.0s: first"
    assert lines[1] == "sweep [4/4] elapsed 4.0s, ETA 0.0s: done"
    assert lines[2] == "sweep [0/2] elapsed 0.0s, ETA ?: again"
    assert lines[3] == "sweep [0/2] elapsed 1.0s, ETA ?: still"


def test_progress_on_a_terminal_draws_a_rich_bar() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, description="demo", tty=True)
    bar(1, 2, "step 1")
    bar(2, 2, "step 2")  # reaching the total stops the live display
    text = out.getvalue()
    assert "demo" in text and "2/2" in text and "ETA" in text and "step 2" in text
    assert bar._live is None


def test_a_policy_that_drops_records_is_marked_not_comparable() -> None:
    """The default table shows capacity's drop share and says its step time is not
    comparable; the others' cells are plain ratios."""
    from moonplan.simulate.report import NOT_COMPARABLE

    spec = SweepSpec(model="mixtral-8x7b", ranks=(4,), sigmas=(1.5,), tokens=64, steps=2,
                     warmup=1, policies=("static-linear", "capacity-1.0"))  # fmt: skip
    rows = sweep(spec)
    cap = next(r for r in rows if r["policy"] == "capacity-1.0")
    assert cap["dropped_fraction"] > 0
    table = sweep_table(rows)
    assert f"({cap['rel_ideal']:.2f}) {cap['dropped_fraction']:.0%} dropped" in table
    assert NOT_COMPARABLE in table and "dropped" not in sweep_table(rows[:1])


def test_the_deployed_eplb_is_primed_from_the_steps_before_the_trace() -> None:
    """A generated point gives the deployed EPLB its window before the trace, in the middle
    of its period: its placement is planned from loads (not uniform), and a share of its
    next moves rides beside every step; the measured default is 32 steps after 8."""
    assert (SweepSpec().steps, SweepSpec().warmup) == (32, 8)
    spec = SweepSpec(model="deepseek-v3", ranks=(8,), sigmas=(1.0,), tokens=256, steps=2,
                     warmup=1, policies=("static-linear", "eplb"))  # fmt: skip
    rows = {r["policy"]: r for r in sweep(spec)}
    assert rows["eplb"]["total_us"] < rows["static-linear"]["total_us"]
    assert 0 < rows["eplb"]["new_copies"] < 1  # a 3000th of a rearrangement a step
    assert rows["eplb"]["prefetch_us"] > 0
