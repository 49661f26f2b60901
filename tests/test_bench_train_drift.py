"""``bench/bench_train_drift.py``: training on drifting routing over long windows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_train_drift as bench

from moonplan.simulate.acceptance import AUTO, recorded_options
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.simulate.sweep import policy_options, simulate_trace
from moonplan.stepcost.hardware import get_hardware
from moonplan.traces.real import real_traces


@pytest.fixture(scope="module")
def counts_TRE():
    return real_traces(("train",))["train-l0"]


def test_the_last_window_is_the_sweeps_point(counts_TRE) -> None:
    """Its ``auto`` over the last 32 steps is the acceptance sweep's ratio to the ideal."""
    row = bench.point("train-l0", counts_TRE, "h200-node", ())
    T, R, _ = counts_TRE.shape
    h = get_hardware("h200-node")
    opts = {**policy_options(h, R, eplb=recorded_options(T, 32)), "stale_slots": True}
    swept = simulate_trace(counts_TRE, get_model(bench.MODEL), h, SimConfig(training=True), (AUTO,),
                           warmup=T - 32, options=opts)  # fmt: skip
    assert row["ratios"]["auto"]["last 32"] == pytest.approx(swept[0]["rel_ideal"], rel=1e-9)
    assert set(row["ratios"]) == {"auto", "order@200", f"order@{T - 32}"}
    assert all(r >= 1.0 for by_window in row["ratios"].values() for r in by_window.values())


def test_a_faster_host_divides_only_autos_decision_rates() -> None:
    cfg = SimConfig()
    fast = bench.faster(cfg, 4)
    cost, quick = (c.step_cost(get_model(bench.MODEL), get_hardware("h200-node"), AUTO, 8)
                   for c in (cfg, fast))  # fmt: skip
    assert quick.decide_s == pytest.approx(cost.decide_s / 4) and quick.decide_s > 0
    assert quick.score_s == pytest.approx(cost.score_s / 4)
    assert quick.plan_s == cost.plan_s and quick.exit_s == cost.exit_s
