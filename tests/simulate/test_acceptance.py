"""The acceptance sweep of moonplan-auto (reduced grid) and auto's consistency with the model."""

from __future__ import annotations

import pytest
import torch

import moonplan
from moonplan.baselines.planner_time import ROUND_US
from moonplan.baselines.registry import make_policy
from moonplan.simulate.acceptance import (
    AUTO,
    IDEAL_POINT,
    ORDERED,
    PEER_BAR,
    PEERS,
    AcceptanceGrid,
    acceptance_point,
    classify,
    failures,
    profile_loads,
    recorded_options,
    run_acceptance,
    run_recorded,
    standings,
    worst,
)
from moonplan.simulate.model_time import SimConfig, step_time
from moonplan.simulate.models import get_model
from moonplan.simulate.sweep import SweepSpec, spec_point
from moonplan.simulate.workload import drifting_counts
from moonplan.stepcost import get_hardware


def test_grid_points_need_at_least_one_expert_per_rank() -> None:
    grid = AcceptanceGrid(models=("mixtral-8x7b", "deepseek-v3"), hardware=("h200-node",),
                          ranks=(8, 16), sigmas=(0.0, 1.0), tokens=(16,))  # fmt: skip
    points = grid.points()
    assert ("mixtral-8x7b", "h200-node", 8, 1.0, 16) in points
    assert not [p for p in points if p[0] == "mixtral-8x7b" and p[2] == 16]
    assert len(points) == 2 + 4
    assert len(AcceptanceGrid().points()) == 3 * 4 * 6 + 2 * 3 * 3 * 4 * 6
    with pytest.raises(ValueError):
        AcceptanceGrid(hardware=("nope",)).points()


@pytest.mark.parametrize("serial", [False, True])
def test_auto_step_time_is_its_plans_predicted_time(serial: bool) -> None:
    """The simulator charges ``moonplan-auto`` what its plan predicts for itself: one
    planner call, or the early exit's (its test, and the resident candidate's build where
    the exit made it), and its background work only where it does not fit."""
    model, hw = get_model("deepseek-v3"), get_hardware("h200-multinode")
    cfg = SimConfig(overlap_prefetch=not serial)
    cost = cfg.step_cost(model, hw, AUTO, 16)
    assert cost.overlap is not serial and cost.plan_s > cost.exit_s > 0
    policy = make_policy(AUTO, 16, model.num_experts, cost=cost)
    counts = drifting_counts(16, model.num_experts, 2048, model.top_k, sigma=1.5, steps=4)
    for c in counts:
        previous = policy._previous
        p = moonplan.plan(c, slots=policy.slots, previous=previous, policy="auto", cost=cost,
                          backend="torch", rent=policy.rent)  # fmt: skip
        step = policy.step(c)
        assert step.choice == p.policy and torch.equal(step.alloc_ER, p.alloc.cpu())
        t = step_time(step, model, hw, cfg)
        charge = cost.plan_s + int(p.choice.rounds) * cost.round_s  # the call, its rounds
        if p.choice.early_exit():  # the test, and the resident build where the exit made it
            charge = cost.exit_s + int(p.choice.rounds) * cost.round_s
        assert cost.round_s == ROUND_US * 1e-6  # SimConfig's
        assert t.plan_s == pytest.approx(charge, rel=1e-12)
        if not step.local_copies and step.refill_ER is None:
            own = cost.exit_s if p.choice.early_exit() else cost.plan_s  # the plan's own charge
            assert t.total_s == pytest.approx(p.choice.predicted()[p.policy] - own + charge)


def test_acceptance_point_ratios() -> None:
    grid = AcceptanceGrid(steps=1, warmup=2)
    row = acceptance_point(("deepseek-v3", "h200-node", 8, 1.0, 1024), grid)
    assert set(row["us"]) == {*PEERS, AUTO}
    best = min(row["us"][p] for p in PEERS)
    assert row["best_peer_us"] == best and row["us"][row["best_peer"]] == best
    assert row["vs_peers"] == pytest.approx(row["us"][AUTO] / best)
    assert row["vs_ideal"] == pytest.approx(row["us"][AUTO] / row["ideal_us"])
    assert sum(row["choices"].values()) == 1
    assert row["unplanned_us"] <= row["us"][AUTO] + 1e-9
    assert row["vs_peers_unplanned"] == pytest.approx(row["unplanned_us"] / best)
    assert row["vs_static"] == pytest.approx(row["us"][AUTO] / row["us"]["static-linear"])
    again = acceptance_point(("deepseek-v3", "h200-node", 8, 1.0, 1024), grid)
    assert again["us"][AUTO] == row["us"][AUTO]  # the same trace, the same steps: rerun alike
    with pytest.raises(ValueError, match="needs"):
        acceptance_point(IDEAL_POINT, grid, policies=("static-linear",))


def test_failures_and_worst_by_hand() -> None:
    ok = {"model": "m", "hardware": "h", "ranks": 8, "sigma": 0.0, "tokens": 16,
          "vs_peers": 1.0, "vs_ideal": 2.0}  # fmt: skip
    slow = {**ok, "tokens": 64, "vs_peers": PEER_BAR + 1e-6}
    keys = ("model", "hardware", "ranks", "sigma", "tokens")
    ideal_ok = {**ok, **dict(zip(keys, IDEAL_POINT, strict=True)), "vs_ideal": 1.05}
    ideal_bad = {**ideal_ok, "vs_ideal": 1.07}
    assert failures([ok, ideal_ok]) == []
    assert failures([ok, slow, ideal_bad]) == [slow, ideal_bad]
    assert worst([ok, slow, ideal_ok], 2) == [slow, ok]


def test_classify_by_hand() -> None:
    us = {"static-linear": 200.0, "eplb": 100.0, "moonep-greedy": 130.0,
          "moonplan-resident": 120.0, AUTO: 150.0}  # fmt: skip
    row = {"vs_peers": 1.5, "vs_peers_unplanned": 1.2, "best_peer_us": 100.0, "us": us}
    assert classify(row) == "eplb"
    assert classify({**row, "vs_peers": 1.0}) == ""
    assert classify({**row, "vs_peers_unplanned": 1.0}) == "planning"
    assert classify({**row, "us": {**us, "moonplan-resident": 101.0}}) == "myopia"
    assert classify({**row, "us": {**us, "static-linear": 100.5}}) == "static"
    assert classify({**row, "us": {**us, "static-round-robin": 100.5}}) == "static"
    assert classify({**row, "us": {**us, "moonep-greedy": 100.0}}) == "greedy"
    assert classify({**row, "us": {**us, "moonplan": 100.0}}) == "greedy"
    assert classify({**row, "us": {**us, "eplb-fast": 100.0}}) == "eplb"  # both EPLB models


def test_peers_are_the_ones_auto_is_judged_against() -> None:
    """Issue 22's peers: static (both placements), EPLB (both models), the greedy, moonplan
    exact and resident."""
    assert PEERS == ("static-linear", "static-round-robin", "eplb", "eplb-fast",
                     "moonep-greedy", "moonplan", "moonplan-resident")  # fmt: skip
    grid = AcceptanceGrid()
    assert grid.steps >= 32 and grid.warmup >= 8


def test_standings_count_wins_and_the_worst_ratio_by_hand() -> None:
    # the third point did not run c: it is left out
    rows = [{"us": {"a": 100.0, "b": 100.0, "c": 150.0}},
            {"us": {"a": 120.0, "b": 100.0, "c": 110.0}},
            {"us": {"a": 90.0, "b": 100.0}}]  # fmt: skip
    got = {r["policy"]: r for r in standings(rows, ("a", "b", "c"))}
    assert [got[p]["wins"] for p in "abc"] == [1, 2, 0]  # a tie counts for both
    assert got["a"]["worst"] == pytest.approx(1.2) and got["c"]["worst"] == pytest.approx(1.5)
    assert got["b"]["worst"] == 1.0 and got["a"]["points"] == 2
    assert got["c"]["geomean"] == pytest.approx((1.5 * 1.1) ** 0.5)
    with pytest.raises(ValueError, match="no point"):
        standings(rows[2:], ("a", "b", "c"))


def test_recorded_traces_are_judged_alike() -> None:
    """A recorded trace: its last steps measured, EPLB's schedule fitted before them."""
    assert recorded_options(100, 32) == {"eplb_window": 34, "eplb_period": 34, "eplb_first": 34}
    counts = drifting_counts(8, 256, 64, 8, sigma=1.0, steps=40, seed=3)
    rows = run_recorded({"toy": counts}, "deepseek-v3", ("h200-node",), steps=8,
                        policies=("static-linear", "eplb", AUTO))  # fmt: skip
    (row,) = rows
    assert row["trace"] == "toy" and row["sigma"] is None and row["ranks"] == 8
    assert row["tokens"] == pytest.approx(64.0) and set(row["us"]) == {
        "static-linear",
        "eplb",
        AUTO,
    }
    assert row["vs_peers"] == pytest.approx(row["us"][AUTO] / min(row["us"]["static-linear"],
                                                                  row["us"]["eplb"]))  # fmt: skip
    with pytest.raises(ValueError, match="more than"):
        run_recorded({"toy": counts[:8]}, "deepseek-v3", ("h200-node",), steps=8)


def test_auto_with_a_profile_order_is_judged_beside_auto() -> None:
    """``moonplan-auto-ordered`` takes its order from the last 32 steps of a recorded
    trace's warm-up (the measured steps do not change them) and gets verdicts of its own."""
    counts = drifting_counts(8, 256, 64, 8, sigma=1.0, steps=48, seed=3)
    later = counts.clone()
    later[-8:] = later[-8:].flip(-1)
    assert torch.equal(profile_loads(counts, 8), profile_loads(later, 8))
    assert torch.equal(profile_loads(counts, 8), counts[8:40].sum(1))
    (row,) = run_recorded({"toy": counts}, "deepseek-v3", ("h200-node",), steps=8,
                          policies=("static-linear", AUTO, ORDERED))  # fmt: skip
    assert row["ordered_vs_peers"] == pytest.approx(row["us"][ORDERED] / row["us"]["static-linear"])
    assert row["ordered_choices"] and row["vs_peers"] > 0
    with pytest.raises(ValueError, match="relabel"):  # token routing names experts, not labels
        spec_point(SweepSpec(steps=2, warmup=1), get_model("deepseek-v3"),
                   get_hardware("h200-node"), SimConfig(dispatch="token"), 8, 16, 1.0,
                   ("static-linear", ORDERED))  # fmt: skip


# The reduced grid CI runs (the full grid is bench/bench_auto_sweep.py): one model on the
# two node presets, decode to prefill sizes, no skew and heavy skew.
REDUCED = AcceptanceGrid(models=("deepseek-v3",), hardware=("h200-node", "h200-multinode"),
                         ranks=(8, 16), sigmas=(0.0, 2.0), tokens=(16, 1024, 16384),
                         steps=1, warmup=4)  # fmt: skip


def test_reduced_grid_auto_is_never_slower_than_the_best_peer() -> None:
    rows = run_acceptance(REDUCED)
    assert len(rows) == len(REDUCED.points()) == 24
    bad = [(r["hardware"], r["ranks"], r["sigma"], r["tokens"], round(r["vs_peers"], 3),
            r["best_peer"], r["choices"]) for r in rows if r["vs_peers"] > PEER_BAR]  # fmt: skip
    assert not bad, bad
