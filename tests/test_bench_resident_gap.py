"""``bench/bench_resident_gap.py``: the resident candidate's rounds against the holders' bound."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_resident_gap as bench

from moonplan.simulate.acceptance import AcceptanceGrid


def test_one_point_measures_every_round_count_against_the_bound() -> None:
    grid = dataclasses.replace(AcceptanceGrid(), steps=2, warmup=6)
    row = bench.measure(("mixtral-8x7b", "h200-node", 4, 1.0, 64), grid)
    assert set(row["largest"]) == set(bench.ROUND_COUNTS)
    assert row["bound"] >= row["mean"] > 0
    assert all(v >= row["bound"] for v in row["largest"].values())  # a bound: never beaten
    loads = [row["largest"][n] for n in bench.ROUND_COUNTS]
    assert loads == sorted(loads, reverse=True)  # more rounds never raise the largest load
    assert sum(row["choices"].values()) == grid.steps
