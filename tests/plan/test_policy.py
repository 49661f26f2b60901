"""``policy=`` of ``moonplan.plan``: the candidates, and the ``auto`` choice by a ``StepCost``."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import moonplan
from moonplan import PlanError, check_plan
from moonplan.baselines.moonep_greedy import moonep_greedy_alloc
from moonplan.plan.candidates import bounded_cap, parse_bounded
from moonplan.plan.choose import (
    CANDIDATES,
    GREEDY,
    Inputs,
    balancing_order,
    build,
    horizon_of,
    score,
)
from moonplan.plan.home import home_map
from moonplan.plan.plan_type import PLAN_TENSORS, Plan
from moonplan.plan.screen import lower_bound
from moonplan.stepcost import StepCost
from moonplan.testing import counts
from moonplan.traces import DriftingTrace
from tests.plan.draw import counts_like

H200 = StepCost.from_hardware("h200-node", "deepseek-v3")
MULTI = StepCost.from_hardware("h200-multinode", "mixtral-8x7b")
COMPUTE_ONLY = StepCost(  # only the busiest rank's rows cost: copies, traffic, planning free
    row_flop_s=1e-6,
    weight_read_s=0.0,
    row_mem_s=0.0,
    copy_s_intra=0.0,
    copy_s_inter=0.0,
    dispatch_row_s_intra=0.0,
    dispatch_row_s_inter=0.0,
    combine_row_s_intra=0.0,
    combine_row_s_inter=0.0,
)


@st.composite
def costs(draw: st.DrawFn) -> StepCost:
    """The presets, scaled: cheap to prohibitive copies and planning, either schedule."""
    base = draw(st.sampled_from([H200, MULTI, COMPUTE_ONLY]))
    copy = draw(st.sampled_from([0.0, 0.01, 1.0, 100.0]))
    return base.scaled(
        copy_s_intra=base.copy_s_intra * copy,
        copy_s_inter=base.copy_s_inter * copy,
        plan_s=draw(st.sampled_from([0.0, 5.1e-5, 1e-2])),
        tile_rows=draw(st.sampled_from([1, 16])),
        overlap=draw(st.booleans()),
        horizon=draw(st.sampled_from([1.0, 8.0, 1e6])),
        domain=draw(st.sampled_from([base.domain, 1, 2, 3])),  # several fast-link domains
    )


def _same(a: Plan, b: Plan) -> None:
    for k in PLAN_TENSORS:
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert (a.policy, dict(a.predicted), a.planned, a.load_bound, a.chose, a.basis) == (
        b.policy,
        dict(b.predicted),
        b.planned,
        b.load_bound,
        b.chose,
        b.basis,
    )


def _names(prev: Plan | None) -> list[str]:
    return [n for n in CANDIDATES if n != "resident" or prev is not None]


@given(st.data())
def test_reference_and_torch_choose_the_same_plan_bit_for_bit(data: st.DataObject) -> None:
    first = data.draw(counts(max_ranks=6, max_experts=14, max_records_per_rank=200))
    R, E = first.shape
    slots = data.draw(st.none() | st.integers(0, min(-(-E // R) + 1, E)))
    cost = data.draw(costs())
    prev_ref = prev_got = None
    for step in range(3):
        again = step == 0 or data.draw(st.booleans())  # the same counts: auto may keep
        c = first if again else counts_like(data, first)
        ref = moonplan.plan(
            c, slots=slots, previous=prev_ref, policy="auto", cost=cost, backend="reference"
        )
        got = moonplan.plan(c, slots=slots, previous=prev_got, policy="auto", cost=cost)
        _same(ref, got)
        check_plan(got, c, previous=prev_got)
        prev_ref, prev_got = ref, got


@given(st.data())
def test_every_candidate_meets_its_declared_bound(data: st.DataObject) -> None:
    first = data.draw(counts(max_ranks=7, max_experts=16))
    R, E = first.shape
    slots = data.draw(st.none() | st.integers(0, min(-(-E // R) + 1, E)))
    prev = moonplan.plan(first, slots=slots)
    c = counts_like(data, first)
    N = int(c.sum())
    for name in [*_names(prev), "bounded-0", "bounded-1.5"]:
        ref = moonplan.plan(c, slots=slots, previous=prev, policy=name, backend="reference")
        _same(ref, moonplan.plan(c, slots=slots, previous=prev, policy=name))
        for backend in ("reference", "torch"):
            p = moonplan.plan(c, slots=slots, previous=prev, policy=name, backend=backend)
            assert p.policy == name
            check_plan(p, c, previous=prev)  # strict: the construction, with the declared bound
            check_plan(p, c, previous=prev, strict=False)
            load_R = p.alloc.sum(0)
            assert int(load_R.max()) <= p.load_bound
            eps = parse_bounded(name)
            if eps is not None:
                assert p.load_bound == bounded_cap(N, R, eps)
            if name == "exact":
                assert p.load_bound == -(-N // R)


@given(counts(max_ranks=7, max_experts=16), st.data())
def test_resident_moves_only_to_residents_and_never_past_the_target(
    c: torch.Tensor, data: st.DataObject
) -> None:
    R, E = c.shape
    slots = data.draw(st.integers(0, min(-(-E // R) + 2, E)))
    prev_counts = counts_like(data, c)
    prev = moonplan.plan(prev_counts, slots=slots)
    p = moonplan.plan(c, slots=slots, previous=prev, policy="resident")
    static = moonplan.plan(c, slots=slots, policy="static")
    exact_R = torch.tensor([int(c.sum()) // R + (r < int(c.sum()) % R) for r in range(R)])
    load_R, static_R = p.alloc.sum(0), static.alloc.sum(0)
    grew = load_R > static_R
    assert bool((load_R[grew] <= exact_R[grew]).all())  # receivers: never above the target
    shrank = load_R < static_R
    assert bool((load_R[shrank] >= exact_R[shrank]).all())  # donors: never below it
    assert int(load_R.max()) <= int(static_R.max())
    assert p.new_copies() == 0 and p.summary()["direct"] == 0
    resident = {(e, r) for r, row in enumerate(prev.slot_expert.tolist()) for e in row if e >= 0}
    used = {(int(e), int(r)) for e, r in p.replica_mask().nonzero().tolist()}
    assert used <= resident


def test_auto_needs_a_cost_and_the_cuda_backend_is_exact_only() -> None:
    c = torch.tensor([[5, 1], [0, 0]])
    with pytest.raises(PlanError, match="needs cost=StepCost"):
        moonplan.plan(c, policy="auto")
    with pytest.raises(PlanError, match="cuda backend plans exact balance only"):
        moonplan.plan(c, policy="auto", cost=H200, backend="cuda")
    with pytest.raises(PlanError, match="unknown policy 'fastest'"):
        moonplan.plan(c, policy="fastest")
    with pytest.raises(PlanError, match="unknown policy 'bounded--1'"):
        moonplan.plan(c, policy="bounded--1")


def _charged(c: torch.Tensor, slots: int | None, prev: Plan | None, cost: StepCost) -> dict:
    """Every candidate's score without screening, in auto's order: balancing candidate k
    is charged k runs."""
    R, E = c.shape
    inp = Inputs(
        c,
        -(-E // R) if slots is None else slots,
        1,
        None if prev is None else prev.slot_expert,
        None if prev is None else prev.flow,
        "torch",
    )
    static = build("static", inp)
    load = static.alloc.sum(0).tolist()
    h = horizon_of(cost)
    out = {"static": score(cost.plan_time(static, planned=0), h)}
    if prev is not None:
        out["resident"] = score(cost.plan_time(build("resident", inp), planned=0), h)
    order = balancing_order(load, None if prev is None else prev.policy)
    for runs, (name, _, _) in enumerate(order, start=1):
        out[name] = score(cost.plan_time(build(name, inp), planned=runs), h)
    return out


@given(st.data())
def test_auto_is_never_predicted_slower_than_any_candidate(data: st.DataObject) -> None:
    first = data.draw(counts(max_ranks=6, max_experts=14, max_records_per_rank=300))
    R, E = first.shape
    slots = data.draw(st.none() | st.integers(0, -(-E // R)))
    cost = data.draw(costs())
    prev = None
    if data.draw(st.booleans()):  # a previous plan of any policy (auto builds it first)
        policy = data.draw(st.sampled_from(["exact", "auto", "bounded-0.1", "static"]))
        prev = moonplan.plan(first, slots=slots, policy=policy, cost=cost)
        prev = dataclasses.replace(prev, basis=None)  # a full choice (no keep: test_keep)
    c = counts_like(data, first)
    p = moonplan.plan(c, slots=slots, previous=prev, policy="auto", cost=cost)
    chosen = p.predicted[p.policy]
    assert chosen == min(p.predicted.values())
    assert chosen == score(cost.plan_time(p, planned=chosen_runs(p)), cost.horizon)
    # every candidate, built: the choice is never scored above one of them (those it
    # screened out are beaten by their lower bound, those it built by their score)
    for name, t in _charged(c, slots, prev, cost).items():
        assert chosen <= t * (1 + 1e-12), (name, t, dict(p.predicted))
    assert p.planned == sum(n not in ("static", "resident") for n in p.predicted)


def chosen_runs(p: Plan) -> int:
    """Runs charged to the chosen candidate: the balancing candidates evaluated up to it."""
    names = list(p.predicted)
    upto = names[: names.index(p.policy) + 1]
    return sum(n not in ("static", "resident") for n in upto)


@given(st.data())
def test_lower_bound_is_below_every_balancing_candidate(data: st.DataObject) -> None:
    first = data.draw(counts(max_ranks=6, max_experts=14, max_records_per_rank=300))
    R, E = first.shape
    cost = data.draw(costs())
    slots = data.draw(st.none() | st.integers(0, -(-E // R)))
    prev = moonplan.plan(first, slots=slots) if data.draw(st.booleans()) else None
    c = counts_like(data, first)
    prev_RB = None if prev is None else prev.slot_expert
    B = -(-E // R) if slots is None else slots
    inp = Inputs(c, B, 1, prev_RB, None if prev is None else prev.flow, "torch")
    load = build("static", inp).alloc.sum(0).tolist()
    for name, target, _ in [*balancing_order(load, None), (GREEDY, None, None)]:
        p = build(name, inp)
        lb = lower_bound(
            cost,
            c,
            1,
            target=target,
            prev_RB=prev_RB,
            prev_F3=inp.prev_F3,
            horizon=cost.horizon,
            replay=name != GREEDY,
        )
        assert lb <= score(cost.plan_time(p, planned=1), cost.horizon) * (1 + 1e-12), name
        assert lb <= cost.plan_time(p, planned=1).total_s * (1 + 1e-12), name


def test_score_amortises_only_the_exposed_fetch() -> None:
    c = torch.tensor([[4000, 100, 50, 10, 5, 5, 0, 30]] * 4)
    exact = moonplan.plan(c)
    t = H200.plan_time(exact)
    assert t.prefetch_exposed_s > 0
    assert score(t, 1.0) == t.total_s
    assert score(t, 4.0) == pytest.approx(t.total_s - 0.75 * t.prefetch_exposed_s, rel=1e-12)
    static = moonplan.plan(c, policy="static")
    s = H200.plan_time(static)
    assert s.prefetch_exposed_s == 0 and score(s, 1e9) == s.total_s
    # the simulator's and runtime's prediction stays the full step: horizon only steers
    assert H200.scaled(horizon=100.0).plan_time(exact) == t
    with pytest.raises(PlanError, match="horizon"):
        horizon_of(dataclasses.make_dataclass("C", [("horizon", float)])(0.5))  # type: ignore[arg-type]


def test_a_long_horizon_leaves_static_where_one_step_does_not() -> None:
    # copies cost more than one step's imbalance, less than eight steps' of it
    c = torch.tensor([[3000, 100, 50, 10, 5, 5, 0, 30]] * 4)
    static = H200.plan_time(moonplan.plan(c, policy="static")).total_s
    exact = H200.plan_time(moonplan.plan(c))
    copy = (static - exact.total_s + exact.prefetch_exposed_s) / exact.prefetch_exposed_s
    cost = H200.scaled(copy_s_intra=H200.copy_s_intra * copy * 2)
    one = moonplan.plan(c, policy="auto", cost=cost.scaled(horizon=1.0))
    many = moonplan.plan(c, policy="auto", cost=cost.scaled(horizon=64.0))
    assert one.policy == "static" and many.policy != "static", (
        dict(one.predicted),
        dict(many.predicted),
    )


def test_the_previous_choice_is_built_first_and_screens_the_rest() -> None:
    c = torch.tensor([[4000, 100, 50, 10, 5, 5, 0, 30]] * 4)
    first = moonplan.plan(c, slots=0, policy="bounded-0.1")  # no slots: no resident helps
    p = moonplan.plan(c, slots=0, policy="auto", cost=COMPUTE_ONLY, previous=first)
    assert p.policy == "exact"
    names = [n for n in p.predicted if n not in ("static", "resident")]
    assert names[0] == "bounded-0.1" and names[1] == "exact"
    load = moonplan.plan(c, policy="static").alloc.sum(0).tolist()
    order = [n for n, _, _ in balancing_order(load, "bounded-0.1")]
    assert order[:2] == ["bounded-0.1", "exact"]
    assert order[2:] == [n for n in CANDIDATES[2:] if n not in (*order[:2], GREEDY)]


@given(counts(max_ranks=6, max_experts=14, max_records_per_rank=300))
@example(torch.tensor([[0, 0], [43, 44]]))
def test_exact_balance_when_copies_and_planning_are_free(c: torch.Tensor) -> None:
    p = moonplan.plan(c, policy="auto", cost=COMPUTE_ONLY)
    R = c.shape[0]
    assert int(p.alloc.sum(0).max()) == -(-int(c.sum()) // R)  # exact's busiest rank
    if p.policy != "exact":  # a cheaper candidate ties exact and wins the tie
        # a tie up to rounding: the same busiest rank's rows, summed in another order
        # (c = [[0, 0], [43, 44]]: static's 44 rows against exact's 43 + 1)
        exact = moonplan.plan(c)
        assert p.predicted[p.policy] == pytest.approx(COMPUTE_ONLY.plan_time(exact).total_s)


def test_exact_wins_a_skewed_step_when_copies_are_free() -> None:
    c = torch.tensor([[4000, 100, 50, 10, 5, 5, 0, 30]] * 4)
    p = moonplan.plan(c, policy="auto", cost=COMPUTE_ONLY)
    assert p.policy == "exact"
    # exact is built first; a bounded candidate's busiest rank alone costs more than exact
    assert p.planned == 1 and list(p.predicted) == ["static", "exact"]
    assert torch.equal(p.alloc, moonplan.plan(c).alloc)


@given(counts(max_ranks=6, max_experts=14, families=["uniform", "random"]), st.data())
def test_static_when_copies_are_prohibitive(c: torch.Tensor, data: st.DataObject) -> None:
    base = data.draw(st.sampled_from([H200, MULTI]))
    cost = base.scaled(copy_s_intra=10.0, copy_s_inter=10.0)
    p = moonplan.plan(c, policy="auto", cost=cost)
    assert p.policy == "static"
    assert p.copies() == 0


def test_screening_skips_balancing_when_static_is_already_balanced() -> None:
    c = torch.full((4, 8), 64)
    p = moonplan.plan(c, policy="auto", cost=H200)
    assert p.policy == "static" and p.planned == 0
    assert list(p.predicted) == ["static"]  # every bounded is the static plan; exact screened


def test_with_two_slots_direct_reads_push_towards_fewer_remote_experts() -> None:
    # Rank 0's six equal experts: exact balance sends three of them to rank 1, beyond
    # slots=2, so one is a direct read every step, even with both slots resident.
    c = torch.tensor([[100] * 6 + [0] * 6, [0] * 12])
    prev = moonplan.plan(c, slots=2)
    exact = moonplan.plan(c, slots=2, previous=prev)
    assert exact.summary()["direct"] == 1 and exact.new_copies() == 0
    p = moonplan.plan(c, slots=2, previous=prev, policy="auto", cost=H200)
    assert p.policy == "resident" and p.summary()["direct"] == 0
    assert p.alloc.sum(0).tolist() == [400, 200]  # both residents, no copy
    assert p.predicted["resident"] < H200.plan_time(exact).total_s
    free = moonplan.plan(c, slots=2, previous=prev, policy="auto", cost=COMPUTE_ONLY)
    assert free.policy == "exact" and free.summary()["direct"] == 1  # direct reads cost nothing


def test_chosen_plans_chain_as_previous_and_pickle() -> None:
    trace = DriftingTrace(8, 32, 2048, 4, seed=1, sigma=1.5, rho=0.9)
    prev = None
    picked = set()
    for step in range(12):
        c = trace.step()
        cost = H200.scaled(copy_s_intra=H200.copy_s_intra * (0.1 if step % 3 else 30))
        p = moonplan.plan(c, slots=2, previous=prev, policy="auto", cost=cost)
        check_plan(p, c, previous=prev)
        picked.add(p.policy)
        buf = io.BytesIO()
        torch.save(p, buf)
        buf.seek(0)
        q = torch.load(buf, weights_only=False)
        assert dict(q.predicted) == dict(p.predicted) and q.policy == p.policy
        prev = p
    assert len(picked) >= 2, picked


def test_predicted_is_read_only_and_summary_reports_the_choice() -> None:
    c = torch.tensor([[90, 1, 2, 3], [50, 0, 0, 1]])
    p = moonplan.plan(c, policy="auto", cost=H200)
    with pytest.raises(TypeError):
        p.predicted["static"] = 0.0  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.policy = "exact"  # type: ignore[misc]
    s = p.summary()
    assert s["policy"] == p.policy and s["load_bound"] == p.load_bound
    assert s["predicted"] == dict(p.predicted) and math.isfinite(s["predicted"]["static"])
    exact = moonplan.plan(c)
    assert (exact.policy, dict(exact.predicted), exact.planned) == ("exact", {}, 1)
    assert exact.load_bound == int(exact.target.max())


def test_bounded_targets_shed_to_the_cap_and_fill_the_lowest() -> None:
    c = torch.tensor([[30, 2, 8, 0]])  # one source; expert e lives on rank e
    c = torch.cat([c, torch.zeros(3, 4, dtype=torch.int64)])
    p = moonplan.plan(c, policy="bounded-0.1")
    assert p.alloc.sum(0).tolist() == [11, 10, 10, 9]  # cap 11; 19 shed raise 2, 8, 0 to 9-10
    assert p.load_bound == 11
    assert torch.equal(p.home, home_map(4, 4))


@given(st.data())
def test_greedy_is_the_moonep_greedy_allocation_with_residents_kept(data: st.DataObject) -> None:
    first = data.draw(counts(max_ranks=7, max_experts=16))
    R, E = first.shape
    slots = data.draw(st.none() | st.integers(0, -(-E // R)))
    prev = moonplan.plan(first, slots=slots)
    c = counts_like(data, first)
    greedy = moonep_greedy_alloc(c)  # the baseline, written independently from the description
    assert torch.equal(moonplan.plan(c, slots=slots).alloc, greedy)  # == exact without previous
    for backend in ("reference", "torch"):
        p = moonplan.plan(c, slots=slots, previous=prev, policy=GREEDY, backend=backend)
        assert p.policy == GREEDY and p.planned == 1 and torch.equal(p.alloc, greedy)
        check_plan(p, c, previous=prev)
        resident_ER = torch.zeros(E + 1, R, dtype=torch.bool)
        resident_ER[prev.slot_expert.clamp(min=-1), torch.arange(R)[:, None]] = True
        moved_ER = torch.zeros(E, R, dtype=torch.bool)
        r_N, j_N = p.slot_new.nonzero(as_tuple=True)
        moved_ER[p.slot_expert[r_N, j_N], r_N] = True
        # a resident replica keeps its slot: only replicas not resident are copied
        assert not bool((moved_ER & resident_ER[:E]).any())


def test_auto_takes_the_greedy_where_it_is_predicted_fastest() -> None:
    # rank 0 overloaded; the previous plan filled rank 3 from rank 0 (replayed by exact),
    # the greedy fills the largest deficit (rank 1) instead
    prev_c = torch.tensor([[300, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    prev = moonplan.plan(prev_c.t().contiguous(), slots=1)
    c = torch.tensor([[400, 10, 90, 0]]).expand(4, 4).contiguous() // 4
    exact = moonplan.plan(c, slots=1, previous=prev)
    greedy = moonplan.plan(c, slots=1, previous=prev, policy=GREEDY)
    free = COMPUTE_ONLY
    p = moonplan.plan(c, slots=1, previous=prev, policy="auto", cost=free)
    t_exact, t_greedy = free.plan_time(exact).total_s, free.plan_time(greedy).total_s
    best = min(t_exact, t_greedy)
    assert p.predicted[p.policy] <= best * (1 + 1e-12)
    if t_greedy < t_exact:
        assert p.policy == GREEDY and torch.equal(p.alloc, greedy.alloc)
