"""``bench/bench_decision.py``: one decision's counted builds, host time and charges."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_decision as bench

from moonplan.baselines.decision_time import decision_build_us, decision_score_us
from moonplan.plan.residency.window import WINDOW


def test_the_window_draws_every_ranks_records_from_one_popularity() -> None:
    steps = bench.window(8, 4, 16, 2, 1.0)
    assert len(steps) == WINDOW
    for c_RE in steps:
        assert c_RE.shape == (4, 8) and c_RE.dtype == torch.int64
        assert (c_RE.sum(1) == 16 * 2).all() and (c_RE == c_RE[0]).all()


def test_one_case_counts_its_work_and_charges_the_fit() -> None:
    row = bench.measure(("mixtral-8x7b", "h200-node", 4, 16, 1.0, 2), reps=1)
    assert row["made"] <= WINDOW * 3 + 3 and WINDOW < row["scored"]
    charged_us = row["made"] * decision_build_us(4, 8) + row["scored"] * decision_score_us(4, 8)
    assert row["charged_ms"] == charged_us * 1e-3
    assert row["host_ms"] > 0 and 0 < row["device_ms"] < row["charged_ms"]
    assert row["build_us"] > 0 and row["score_us"] > 0


def test_the_fit_recovers_a_line_and_reports_both_rates() -> None:
    """``fit_line`` finds an exact line's base and slope (positive, by logarithms), and
    ``refit`` reports one refit line per rate beside the charged one."""
    import numpy as np

    x_N = np.array([64.0, 512, 2048, 16384])
    base, slope = bench.fit_line(x_N, 150 + 0.22 * x_N)
    assert abs(base - 150) < 0.5 and abs(slope - 0.22) < 1e-3
    rows = [{"ranks": 8, "experts": e, "build_us": 200.0 + e, "score_us": 60.0 + e / 8}
            for e in (8, 64, 256)]  # fmt: skip
    lines = bench.refit(rows)
    assert len(lines) == 2 and "build_us" in lines[0] and "score_us" in lines[1]
