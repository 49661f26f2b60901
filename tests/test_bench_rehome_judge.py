"""``bench/bench_rehome_judge.py``: the serving re-home judgement's host time."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_rehome_judge as bench


def test_a_window_holds_its_records_every_step() -> None:
    w = bench.window(16, 100)
    assert w.shape == (bench.WINDOW, 16) and bool((w.sum(1) == 100).all())


def test_one_case_times_the_three_parts() -> None:
    row = bench.case("olmoe-1b-7b", 8, 64, reps=1)
    assert row["experts"] == 64 and row["orders"] == 2  # both orders differ from the labels
    assert all(row[k] > 0 for k in ("popular_ms", "judged_ms", "tables_ms"))
