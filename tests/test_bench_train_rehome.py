"""``bench/bench_train_rehome.py``: auto in training, without and with its own re-home."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_train_rehome as bench

from moonplan.simulate.acceptance import AUTO, PEERS


def test_one_point_times_every_peer_and_auto_both_ways() -> None:
    row = bench.point("deepseek-v3", "h200-node", 16, 1.0, 1024)
    assert set(row["us"]) == {*PEERS, AUTO, f"{AUTO} (no re-home)"}
    best = min(row["us"][p] for p in PEERS)
    assert row["after"] == row["us"][AUTO] / best
    assert row["before"] == row["us"][f"{AUTO} (no re-home)"] / best
    assert row["after"] < row["before"]  # a re-home pays here (0.81x, docs/benchmarks.md)
