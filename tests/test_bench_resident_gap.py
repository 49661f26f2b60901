"""``bench/bench_resident_gap.py``: the resident candidate's rounds against the holders' bound."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_resident_gap as bench

from moonplan.plan.choice.resident import ROUND_LIMIT
from moonplan.simulate.acceptance import AcceptanceGrid


def test_one_point_measures_both_stop_rules_against_the_bound() -> None:
    grid = dataclasses.replace(AcceptanceGrid(), steps=2, warmup=6)
    row = bench.measure(("mixtral-8x7b", "h200-node", 4, 1.0, 64), grid)
    paid, falling = row["builds"]["paid"], row["builds"]["falling"]
    assert row["bound"] >= row["mean"] > 0
    assert min(paid["largest"], falling["largest"]) >= row["bound"]  # a bound: never beaten
    assert 1 <= paid["rounds"] <= falling["rounds"] <= ROUND_LIMIT  # paid rounds stop first
    assert falling["largest"] <= paid["largest"]  # more rounds never raise the largest load
    assert sum(row["choices"].values()) == grid.steps
