"""``bench/bench_placed.py``: the whole-expert placement experiment on small hand cases, and
one short run beside the simulator's policies."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_placed as bench

from moonplan.plan.home import home_list
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.stepcost import StepCost
from moonplan.stepcost.hardware import get_hardware

R, E = 4, 8


def _cost() -> StepCost:
    return SimConfig().step_cost(get_model(bench.MODEL), get_hardware("h200-node"),
                                 "moonplan-auto", R)  # fmt: skip


def _hot_counts() -> np.ndarray:
    """``[R, E]``: rank 0's two home experts hold most records, the others a few each."""
    counts_RE = np.full((R, E), 4, dtype=np.int64)
    counts_RE[:, :2] = 200
    return counts_RE


def test_static_over_the_homes_is_static_ep() -> None:
    cost, counts_RE = _cost(), _hot_counts()
    home_E = np.asarray(home_list(E, R))
    alloc_ER = np.zeros((E, R), dtype=np.int64)
    alloc_ER[np.arange(E), home_E] = counts_RE.sum(0)
    want = cost.step_time(alloc_ER, counts_RE, np.zeros((E, R), bool), home_E, planned=0)
    assert bench.static_over(cost, counts_RE, home_E) == want.total_s


def test_the_greedy_moves_a_hot_expert_off_its_home() -> None:
    """Rank 0 runs both hot experts: the placement moves one of them to another rank, and
    the mean step is predicted faster than over the homes."""
    cost, counts_RE = _cost(), _hot_counts()
    server_E = bench.place(cost, counts_RE, slots=1)
    home_E = np.asarray(home_list(E, R))
    assert server_E[0] != home_E[0] or server_E[1] != home_E[1]
    assert bench.static_over(cost, counts_RE, server_E) < bench.static_over(cost, counts_RE, home_E)


@pytest.mark.parametrize("slots", [0, 1, 2])
def test_no_rank_takes_more_experts_than_its_slots(slots: int) -> None:
    cost = _cost()
    rng = np.random.default_rng(slots)
    counts_RE = rng.integers(0, 300, size=(R, E))
    server_E = bench.place(cost, counts_RE, slots)
    home_E = np.asarray(home_list(E, R))
    moved = server_E != home_E
    assert (np.bincount(server_E[moved], minlength=R) <= slots).all()
    assert bench.static_over(cost, counts_RE, server_E) <= bench.static_over(
        cost, counts_RE, home_E
    )


def test_an_even_load_moves_nothing() -> None:
    cost = _cost()
    counts_RE = np.full((R, E), 10, dtype=np.int64)
    assert (bench.place(cost, counts_RE, 2) == np.asarray(home_list(E, R))).all()


@pytest.mark.parametrize("seed", range(4))
def test_the_nocopy_bound_is_below_static_and_placed(seed: int) -> None:
    """Static EP and ``placed`` copy nothing over the placement's holders: neither is
    predicted faster than the bound."""
    cost = _cost()
    rng = np.random.default_rng(seed)
    counts_RE = rng.integers(0, 300, size=(R, E)) * (rng.random((R, E)) < 0.7)
    server_E = bench.place(cost, counts_RE, 2)
    low = bench.nocopy_bound(cost, counts_RE, server_E)
    home_E = np.asarray(home_list(E, R))
    assert low <= bench.static_over(cost, counts_RE, server_E) * (1 + 1e-12)
    assert low <= bench.static_over(cost, counts_RE, home_E) * (1 + 1e-12)


@pytest.mark.slow
def test_a_short_run_reports_the_peers_and_the_placement() -> None:
    (row,) = bench.run(("decode-l1",), ("h200-node",))
    assert set(row["us"]) == set(bench.PEERS)
    assert row["with_copies_us"] >= row["placed_us"] > 0 and row["period"] > 0
    assert row["best_peer_us"] == min(row["us"][p] for p in bench.PEERS[:3])
