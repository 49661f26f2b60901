"""Step-time model on hand-computed cases."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moonplan.baselines.planner_time import exact_us
from moonplan.baselines.policy_base import make_step
from moonplan.baselines.registry import make_policy
from moonplan.cost import GQAAttention, ModelPreset
from moonplan.plan.residency.refill import refill_link_s
from moonplan.simulate.model_time import (
    SimConfig,
    StepTime,
    ideal_time,
    mean_time,
    moves_link_s,
    step_time,
)
from moonplan.stepcost.hardware import get_hardware
from moonplan.stepcost.traffic import dispatch_traffic

HW = get_hardware("h200-node")
NO_PLAN = SimConfig(plan_us={})


def toy(experts: int, top_k: int = 1, hidden: int = 4096, ffn: int = 4096) -> ModelPreset:
    return ModelPreset(
        name="toy",
        hidden_size=hidden,
        moe_intermediate_size=ffn,
        num_layers=2,
        num_experts=experts,
        top_k=top_k,
        vocab_size=16,
        attention=GQAAttention(num_heads=1, num_kv_heads=1, head_dim=8),
    )


BALANCED_POLICIES = [
    "static-linear",
    "static-round-robin",
    "capacity-1.0",
    "moonep-greedy",
    "moonplan",
    "moonplan-resident",
]


def test_balanced_input_gives_identical_times_for_every_policy() -> None:
    R, E, c = 4, 8, 1024  # every source routes c records to every expert
    counts = torch.full((R, E), c, dtype=torch.int64)
    model = toy(E, top_k=2)
    ideal = ideal_time(int(counts.sum()), R, model, HW, NO_PLAN)
    for name in [*BALANCED_POLICIES, "eplb"]:
        opts = {"redundant": 0} if name == "eplb" else {}
        t = step_time(make_policy(name, R, E, **opts).step(counts), model, HW, NO_PLAN)
        assert t.total_s == pytest.approx(ideal.total_s, rel=1e-12), name
        assert t.experts_s == pytest.approx(ideal.experts_s, rel=1e-12), name
        assert t.dispatch_s == pytest.approx(ideal.dispatch_s, rel=1e-12), name
        assert t.prefetch_s == 0.0


def test_planning_time_is_added_on_the_critical_path() -> None:
    counts = torch.full((4, 8), 256, dtype=torch.int64)
    model, cfg = toy(8, top_k=2), SimConfig()  # moonplan: its kernel's time at (R, E)
    static = step_time(make_policy("static-linear", 4, 8).step(counts), model, HW, cfg)
    ours = step_time(make_policy("moonplan", 4, 8).step(counts), model, HW, cfg)
    kernel_s = exact_us(4, 8) * 1e-6
    assert ours.plan_s == pytest.approx(kernel_s)
    assert ours.total_s == pytest.approx(static.total_s + kernel_s, rel=1e-12)


def test_only_the_slot_placement_is_charged_a_decisions_host_rates() -> None:
    """``moonplan-auto``'s cost carries the host's rates per counted build and per scored
    (step, table) at its (R, E) (``decision_time``); a policy that places no slots has
    none."""
    from moonplan.baselines.decision_time import decision_build_us, decision_score_us

    model, cfg = toy(8, top_k=2), SimConfig()
    auto = cfg.step_cost(model, HW, "moonplan-auto", 4)
    assert auto.decide_s == pytest.approx(decision_build_us(4, 8) * 1e-6, rel=1e-12)
    assert auto.score_s == pytest.approx(decision_score_us(4, 8) * 1e-6, rel=1e-12)
    exact = cfg.step_cost(model, HW, "moonplan", 4)
    assert exact.decide_s == exact.score_s == 0.0
    # the lines within 0.64-1.66x of each rate measured (bench_decision, 2026-12-04): at
    # DeepSeek-V3 EP 64, 4.5-5.2 ms a build and 0.92-0.99 ms a pair
    assert 4_500 / 1.66 <= decision_build_us(64, 256) <= 5_200 / 0.64
    assert 920 / 1.66 <= decision_score_us(64, 256) <= 990 / 0.64


def test_one_hot_expert_costs_static_ep_R_times_the_ideal_expert_time() -> None:
    R, n = 4, 8192  # every rank routes n records (K=1) to expert 0; compute-bound rows
    counts = torch.zeros(R, R, dtype=torch.int64)
    counts[:, 0] = n
    model = toy(R, top_k=1)
    ideal = ideal_time(R * n, R, model, HW, NO_PLAN)
    assert ideal.experts_s == pytest.approx(6 * 4096 * 4096 * n / HW.flops, rel=1e-12)
    static = step_time(make_policy("static-linear", R, R).step(counts), model, HW, NO_PLAN)
    assert static.experts_s == pytest.approx(R * ideal.experts_s, rel=1e-12)
    ours = step_time(make_policy("moonplan", R, R).step(counts), model, HW, NO_PLAN)
    # a receiver's copy writes one expert's weights beside its (empty) home section
    write_s = NO_PLAN.step_cost(model, HW).weight_read_s
    assert ours.experts_s == pytest.approx(ideal.experts_s + write_s, rel=1e-12)
    assert ours.prefetch_s > 0  # R-1 replicas of expert 0 move from rank 0


def test_capacity_1_25_computes_a_quarter_more_padded_rows() -> None:
    R, E, c = 2, 4, 1024
    counts = torch.full((R, E), c, dtype=torch.int64)
    model = toy(E, top_k=2)
    base = step_time(make_policy("capacity-1.0", R, E).step(counts), model, HW, NO_PLAN)
    big = step_time(make_policy("capacity-1.25", R, E).step(counts), model, HW, NO_PLAN)
    assert big.experts_s == pytest.approx(1.25 * base.experts_s, rel=1e-12)


def test_expert_roofline_by_hand() -> None:
    model = toy(2, hidden=1024, ffn=1024)
    rows = torch.tensor([[1, 0], [0, 0]])  # one row of expert 0 on rank 0; rank 1 idle
    t_R = NO_PLAN.step_cost(model, HW).experts_R(rows)
    weights = 3 * 1024 * 1024 * 2
    flops = 6 * 1024 * 1024 * 128  # padded to one 128-row tile
    assert t_R[0] == pytest.approx(max(flops / HW.flops, (weights + 4096 * 2) / HW.hbm_bytes_per_s))
    assert t_R[1] == 0.0


def test_two_rank_dispatch_by_hand() -> None:
    counts = torch.tensor([[5, 3], [7, 1]])  # rank 0 sends 3 to rank 1, receives 7
    step = make_policy("static-linear", 2, 2).step(counts)
    H = 4096
    traffic = dispatch_traffic(step.sent_RE, step.rows_ER, HW.domain(2))
    assert int(traffic.recv_intra_R.max()) == 7
    expect = HW.base_latency_s + HW.per_peer_latency_s + 7 * H * 2 / HW.nvlink_effective
    t = step_time(step, toy(2), HW, NO_PLAN)
    assert t.dispatch_s == pytest.approx(expect) and t.combine_s == pytest.approx(expect)


def test_fetch_uses_the_slowest_link() -> None:
    multi = get_hardware("h200-multinode")
    model = toy(16, hidden=1024, ffn=1024)
    serial = SimConfig(plan_us={}, overlap_prefetch=False)
    cost = serial.step_cost(model, multi)
    rows_ER = torch.zeros(16, 16, dtype=torch.int64)
    rows_ER[0, [0, 1, 9]] = 1  # expert 0 (home rank 0) also runs on ranks 1 and 9
    sent_RE = torch.zeros(16, 16, dtype=torch.int64)
    sent_RE[0, 0] = 3
    fetch_ER = torch.zeros(16, 16, dtype=torch.bool)
    fetch_ER[0, [1, 9]] = True  # one copy inside rank 0's node, one across nodes
    src_E = torch.zeros(16, dtype=torch.int64)
    t = cost.step_time(rows_ER, sent_RE, fetch_ER, src_E)
    one_expert = 3 * 1024 * 1024 * 2
    assert t.prefetch_s == pytest.approx(multi.base_latency_s + one_expert / multi.net_effective)
    assert t.prefetch_exposed_s == pytest.approx(t.prefetch_s)
    none = cost.step_time(rows_ER, sent_RE, torch.zeros_like(fetch_ER), src_E)
    assert none.prefetch_s == 0.0 and none.prefetch_exposed_s == 0.0


def test_overlapped_schedule_hides_what_dispatch_and_home_rows_cover() -> None:
    counts = torch.zeros(4, 4, dtype=torch.int64)
    counts[:, 0] = 512
    step = make_policy("moonplan", 4, 4).step(counts)
    over = step_time(step, toy(4), HW, SimConfig(plan_us={}))
    serial = step_time(step, toy(4), HW, SimConfig(plan_us={}, overlap_prefetch=False))
    assert over.prefetch_s == pytest.approx(serial.prefetch_s) and over.prefetch_s > 0
    assert over.total_s < serial.total_s
    assert 0 <= over.prefetch_exposed_s <= serial.prefetch_exposed_s
    assert serial.total_s == pytest.approx(
        serial.prefetch_s + serial.dispatch_s + serial.experts_s + serial.combine_s
    )


def test_ideal_with_fewer_experts_than_ranks_and_single_rank() -> None:
    model = toy(2, hidden=1024, ffn=1024)
    t = ideal_time(4 * 1280, 4, model, HW, NO_PLAN)  # 1280 rows of one expert per rank
    compute = 6 * 1024 * 1024 * 1280 / HW.flops
    memory = (3 * 1024 * 1024 * 2 + 1280 * 4096 * 2) / HW.hbm_bytes_per_s
    assert t.experts_s == pytest.approx(max(compute, memory))
    one = ideal_time(100, 1, model, HW, NO_PLAN)
    assert one.dispatch_s == 0.0 and one.combine_s == 0.0


def test_mean_time_and_units() -> None:
    a, b = StepTime(1, 2, 0, 3, 4, 5, 15), StepTime(3, 2, 0, 1, 0, 1, 7)
    m = mean_time([a, b])
    assert (m.plan_s, m.total_s) == (2, 11)
    assert a.as_us()["total_us"] == 15e6
    with pytest.raises(ValueError):
        mean_time([])
    assert math.isclose(SimConfig().plan_seconds("moonplan", 8, 896), 20.8e-6)  # measured
    assert math.isclose(SimConfig().plan_seconds("moonep-greedy", 64, 384), 51e-6)
    assert SimConfig().plan_seconds("static-linear") == 0.0


# ---- work beside the step: the background search's excess, the refill's exposed copies -------


def test_refill_is_hidden_behind_the_experts_phase_and_the_rest_exposed() -> None:
    multi = get_hardware("h200-multinode")
    model = toy(16, hidden=1024, ffn=1024)
    cfg = SimConfig(plan_us={})
    cost = cfg.step_cost(model, multi)
    src_E = torch.arange(16)  # expert e at home on rank e
    for rows in (1, 1 << 16):  # a short and a long experts phase
        counts = torch.zeros(16, 16, dtype=torch.int64)
        counts[0, 0] = rows
        alloc = torch.diag(counts.sum(0))
        refill = torch.zeros(16, 16, dtype=torch.bool)
        refill[0, 9] = True  # one copy across nodes
        base = step_time(make_step("moonplan-auto", counts, alloc, src_E=src_E), model,
                         multi, cfg)  # fmt: skip
        step = make_step("moonplan-auto", counts, alloc, src_E=src_E, refill_ER=refill)
        t = step_time(step, model, multi, cfg)
        link = refill_link_s(cost, refill, src_E)
        one_expert = 3 * 1024 * 1024 * 2
        assert link == pytest.approx(multi.base_latency_s + one_expert / multi.net_effective)
        exposed = max(0.0, link - base.experts_s)
        assert t.total_s == pytest.approx(base.total_s + exposed, rel=1e-12)
        assert t.prefetch_s == pytest.approx(link) and t.prefetch_exposed_s == pytest.approx(
            exposed
        )
        assert (exposed > 0) == (rows == 1) and step.new_copies == 1
    assert refill_link_s(cost, torch.zeros(16, 16, dtype=torch.bool), src_E) == 0.0


def test_eplb_moves_are_charged_like_moonplans_copies() -> None:
    """EPLB's background moves: their link time by moonplan's fetch rule (the same seconds
    as a refill of the same copies from the same sources), a ``background_share`` of it
    beside the step, hidden behind the experts phase, the rest exposed."""
    multi = get_hardware("h200-multinode")
    model = toy(16, hidden=1024, ffn=1024)
    cfg = SimConfig(plan_us={})
    cost = cfg.step_cost(model, multi)
    src_E = torch.arange(16)
    moves = torch.tensor([[0, 9], [1, 9], [2, 3]])  # two across nodes into rank 9, one inside
    refill = torch.zeros(16, 16, dtype=torch.bool)
    refill[0, 9] = refill[1, 9] = refill[2, 3] = True
    link = moves_link_s(cost, moves, 16)
    assert link == pytest.approx(refill_link_s(cost, refill, src_E), rel=1e-12)
    one_expert = 3 * 1024 * 1024 * 2
    assert link == pytest.approx(multi.base_latency_s + 2 * one_expert / multi.net_effective)
    counts = torch.zeros(16, 16, dtype=torch.int64)
    counts[0, 0] = 1
    alloc = torch.diag(counts.sum(0))
    base = step_time(make_step("eplb", counts, alloc), model, multi, cfg)
    for share in (1.0, 0.25, 1e-6):
        step = make_step("eplb", counts, alloc, background_C2=moves, background_share=share)
        t = step_time(step, model, multi, cfg)
        exposed = max(0.0, share * link - base.experts_s)
        assert t.total_s == pytest.approx(base.total_s + exposed, rel=1e-12)
        assert t.prefetch_s == pytest.approx(share * link)
        assert step.new_copies == pytest.approx(3 * share)
    assert moves_link_s(cost, torch.zeros(0, 2, dtype=torch.int64), 16) == 0.0


def test_a_trace_whose_placement_changes_costs_more_than_one_whose_does_not() -> None:
    """``eplb-fast`` on two traces with the same loads each step: one hot expert that stays,
    or one that moves to another rank every 4 steps. The moving one re-places, and its
    moves are charged (exposed at decode size, where the experts phase hides little)."""
    from moonplan.simulate.sweep import simulate_trace

    model, hw = toy(16, top_k=1, hidden=1024, ffn=1024), get_hardware("h200-multinode")
    R, E, T = 16, 16, 24

    def trace(moving: bool) -> torch.Tensor:
        out = torch.ones(T, R, E, dtype=torch.int64)
        for step in range(T):
            hot = (step // 4) % 2 * 8 if moving else 0
            out[step, :, hot] = 8
        return out

    rows = {m: simulate_trace(trace(m), model, hw, SimConfig(plan_us={}), ["eplb-fast"],
                              warmup=8)[0] for m in (False, True)}  # fmt: skip
    assert rows[False]["prefetch_us"] == 0.0 and rows[False]["moved_mb"] == 0.0
    assert rows[True]["moved_mb"] > 0 and rows[True]["prefetch_exposed_us"] > 0
    assert rows[True]["total_us"] > rows[False]["total_us"] + rows[True]["prefetch_exposed_us"] / 2


def test_a_training_step_adds_the_backward_and_charges_a_rehome_once() -> None:
    """With ``SimConfig(training=True)`` each step (and the ideal) is its forward and the
    backward that replays its plan; a re-home's rows, moved between the steps, once."""
    from moonplan.stepcost.training import training_time

    R, E = 4, 8
    counts = torch.zeros(R, E, dtype=torch.int64)
    counts[:, 0], counts[:, 1:] = 4096, 256  # expert 0 hot, on rank 0
    model, training = toy(E, top_k=2), dataclasses.replace(NO_PLAN, training=True)
    step = make_policy("static-linear", R, E).step(counts)
    forward = step_time(step, model, HW, NO_PLAN)
    assert step_time(step, model, HW, training) == training_time(forward)
    moved = dataclasses.replace(step, blocking_s=1e-3)
    once = step_time(step, model, HW, training).total_s
    assert step_time(moved, model, HW, training).total_s - once == pytest.approx(1e-3, rel=1e-9)
    ideal = ideal_time(int(counts.sum()), R, model, HW, NO_PLAN)
    assert ideal_time(int(counts.sum()), R, model, HW, training) == training_time(ideal)
    ratio = step_time(step, model, HW, training).total_s / training_time(ideal).total_s
    assert ratio > forward.total_s / ideal.total_s  # the imbalance weighs more in training
