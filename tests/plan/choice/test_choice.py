"""``policy="auto"``: every form gives the reference's plan, and the choice's properties.

Legend: R ranks, E experts, B slots, M = ceil(E/R).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import moonplan
from moonplan import PlanError, check_plan
from moonplan.baselines.moonep_greedy import moonep_greedy_alloc
from moonplan.plan.choice import PATHS, choose, reference
from moonplan.plan.choice.rent import exit_build_s
from moonplan.plan.choice.table import LEVELS, RESIDENT, names, placed_index, table
from moonplan.plan.home import home_list
from moonplan.plan.plan_time import plan_time
from moonplan.plan.plan_type import PLAN_TENSORS, Plan
from moonplan.plan.reference import previous_flows
from moonplan.plan.residency.serving import serving_plan
from moonplan.stepcost import StepCost
from moonplan.testing import counts
from moonplan.traces import DriftingTrace
from tests.plan.choice.costs import COMPUTE_ONLY, DECODE, H200, MULTI, costs, full, tiles_costs
from tests.plan.draw import counts_like

CPU_PATHS = tuple(p for p in PATHS if p != "cuda")  # the kernel: test_choice_kernel_*.py


def _same(a: Plan, b: Plan) -> None:
    for k in PLAN_TENSORS:
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert a.choice is not None and b.choice is not None
    assert torch.equal(a.choice.scores, b.choice.scores)  # bit for bit, inf included
    assert (a.policy, a.choice.early_exit(), a.planned) == (b.policy, b.choice.early_exit(), 1)
    for k in ("rounds", "credit", "pending"):
        assert torch.equal(getattr(a.choice, k).cpu(), getattr(b.choice, k).cpu()), k


def _auto(c: torch.Tensor, slots: int, prev: Plan | None, cost, path: str) -> Plan:
    return choose(c, slots, 1, prev, cost, path)


@given(st.data())
@settings(deadline=None)
def test_every_form_is_the_reference_bit_for_bit(data: st.DataObject) -> None:
    """Random and adversarial counts, chains of previous plans, B from 0 to 2M + 3."""
    first = data.draw(counts(max_ranks=6, max_experts=14, max_records_per_rank=300))
    R, E = first.shape
    M = -(-E // R)
    slots = data.draw(st.integers(0, min(2 * M + 3, E)))
    cost = data.draw(costs())
    prev = {path: None for path in CPU_PATHS}
    for step in range(3):
        c = first if step == 0 or data.draw(st.booleans()) else counts_like(data, first)
        got = {path: _auto(c, slots, prev[path], cost, path) for path in CPU_PATHS}
        for path in CPU_PATHS[1:]:
            _same(got["reference"], got[path])
        check_plan(got["host"], c, previous=prev["host"])
        prev = got


def _free_scores(c: torch.Tensor, slots: int, prev: Plan, cost: StepCost) -> list[float]:
    """Every candidate's score with its copies resident (the reference's own forms)."""
    step = reference.Step(
        c.tolist(), slots, 1, prev.slot_expert.tolist(), previous_flows(prev.flow)
    )
    built = [reference.build(k, step, LEVELS, cost) for k in table()]
    return [reference._time(cost, step, a, cost.plan_s, free=True) for a, _ in built]


def _copies(c: torch.Tensor, slots: int, prev: Plan, cost: StepCost) -> list[bool]:
    """Whether each candidate fetches a replica that ``prev``'s slots do not hold."""
    step = reference.Step(
        c.tolist(), slots, 1, prev.slot_expert.tolist(), previous_flows(prev.flow)
    )
    R, E = c.shape
    home = home_list(E, R)
    away = [(e, r) for e in range(E) for r in range(R) if r != home[e]]
    out = []
    for k in table():
        a, _ = reference.build(k, step, LEVELS, cost)
        out.append(any(a[e][r] > 0 and (e, r) not in step.resident for e, r in away))
    return out


@given(st.data())
@settings(deadline=None)
def test_chosen_is_predicted_no_slower_than_any_candidate_but_by_its_rent(
    data: st.DataObject,
) -> None:
    """Static EP included; with the early exit, its plan charged the exit alone is below
    every candidate charged its planning (with residents: every candidate that copies),
    or above by less than a full call's planning beyond the test (the exit keeps its plan
    above the bound only until a call could have paid for itself: ``rent.exit_rent``).
    A step above its least score
    bought copies, by at most the rent (its least score less the least free score, and
    the call's planning beyond the test when only the credit forced it)."""
    first = data.draw(counts(max_ranks=6, max_experts=14, max_records_per_rank=300))
    R, E = first.shape
    slots = data.draw(st.integers(0, E))
    cost = data.draw(costs())
    prev = moonplan.plan(counts_like(data, first), slots=slots)
    p = _auto(first, slots, prev, cost, "host")
    if R == 1:  # one rank: nothing but static EP exists, and the bound is infinite
        assert p.choice.early_exit() and p.policy == "static"
        return
    every = _auto(first, slots, prev, full(cost), "host")  # every candidate scored
    scores = every.choice.scores.tolist()
    assert all(math.isfinite(s) for s in scores) and len(scores) == LEVELS + 4
    mine = float(p.choice.scores[int(p.choice.index)])
    free = _free_scores(first, slots, prev, cost)
    if p.choice.early_exit() and bool((prev.slot_expert >= 0).any()):
        # with residents the exit's contract: no candidate that copies beats it by a full
        # call's price, and the resident candidate stands for the plans that copy nothing
        fetches = _copies(first, slots, prev, cost)
        checking = max(0.0, cost.plan_s - cost.exit_s)
        assert all(mine <= s + checking for s, f in zip(scores, fetches, strict=True) if f)
        assert float(p.choice.pending) < checking or float(p.choice.pending) == 0.0
        static_at_exit = scores[0] - cost.plan_s + cost.exit_s  # in another order: rounding
        assert mine <= static_at_exit * (1 + 1e-12)
    elif mine > min(scores):  # a buy: the least free score's plan, the credit spent
        assert float(p.choice.credit) == 0.0 and mine == scores[free.index(min(free))]
        checking = max(0.0, cost.plan_s - cost.exit_s)  # a full call the credit forced
        assert mine - min(scores) <= checking + (min(scores) - min(free))
    charge = cost.exit_s if p.choice.early_exit() else cost.plan_s
    assert mine == plan_time(cost.scaled(plan_s=charge), p).total_s  # its own prediction


@given(counts(max_ranks=6, max_experts=14, max_records_per_rank=300))
@example(torch.tensor([[0, 0], [43, 44]]))
def test_exact_balance_when_copies_and_planning_are_free(c: torch.Tensor) -> None:
    p = moonplan.plan(c, policy="auto", cost=COMPUTE_ONLY)
    R = c.shape[0]
    assert int(p.alloc.sum(0).max()) == -(-int(c.sum()) // R)  # exact's busiest rank


@given(counts(max_ranks=6, max_experts=14, families=["uniform", "random"]), st.data())
def test_static_when_copies_are_prohibitive(c: torch.Tensor, data: st.DataObject) -> None:
    base = data.draw(st.sampled_from([H200, MULTI]))
    p = moonplan.plan(c, policy="auto", cost=base.scaled(copy_s_intra=10.0, copy_s_inter=10.0))
    assert p.policy == "static" and p.copies() == 0
    assert p.choice is not None and p.choice.early_exit()  # nothing else was built
    assert list(p.predicted) == ["static"]


def test_exact_wins_a_skewed_step_when_copies_are_free() -> None:
    c = torch.tensor([[4000, 100, 50, 10, 5, 5, 0, 30]] * 4)
    p = moonplan.plan(c, policy="auto", cost=COMPUTE_ONLY)
    assert p.policy == "exact" and p.alloc.sum(0).tolist() == [4200] * 4
    assert not p.choice.early_exit() and list(p.predicted) == list(names())


def test_resident_reuses_what_the_previous_step_copied() -> None:
    """Copies free on the first step, prohibitive after: auto balances through the
    replicas the first step left resident and copies nothing more."""
    trace = DriftingTrace(8, 32, 2048, 4, seed=1, sigma=1.5, rho=0.999)
    free = COMPUTE_ONLY.scaled(plan_s=1e-6)
    dear = H200.scaled(copy_s_intra=1.0, copy_s_inter=1.0)
    prev = moonplan.plan(trace.step(), slots=2, policy="auto", cost=free)
    assert prev.new_copies() > 0
    better = 0
    for _ in range(4):
        c = trace.step()
        p = moonplan.plan(c, slots=2, previous=prev, policy="auto", cost=dear)
        check_plan(p, c, previous=prev)
        assert p.new_copies() == 0 and p.summary()["direct"] == 0, p.policy
        static_max = int(moonplan.plan(c, policy="static").alloc.sum(0).max())
        assert int(p.alloc.sum(0).max()) <= static_max
        better += int(p.alloc.sum(0).max()) < static_max
        prev = p
    assert better >= 3  # balanced through the replicas already there


def test_placed_serves_whole_experts_moved_into_the_slots() -> None:
    """Decode-like costs (a weight read is worth 100 rows): rank 0's two home experts are
    hot and expert 1 sits in rank 1's slot. Static EP reads both on rank 0; ``placed`` runs
    expert 1 wholly on rank 1 (one read each, half the rows sent) with a lookup. The exit
    takes it and skips the ``resident`` build, which could not beat it by that build."""
    c = torch.tensor([[50, 50, 0, 0], [50, 50, 0, 0]])
    prev = serving_plan(torch.zeros_like(c), torch.tensor([[-1], [1]]))
    cost = DECODE.scaled(exit_s=1.0, round_s=50.0, plan_s=1000.0)
    for path in CPU_PATHS:
        p = _auto(c, 1, prev, cost, path)
        assert p.policy == "placed" and p.choice.early_exit(), path
        assert p.alloc.tolist() == [[100, 0], [0, 100], [0, 0], [0, 0]]
        assert p.new_copies() == 0 and not math.isfinite(p.choice.scores[RESIDENT])
        assert float(p.choice.scores[placed_index()]) == 1.0 + 50 + 100 + 50
        assert not p.choice.built_resident()
    cheap = cost.scaled(round_s=0.0, weight_read_s=1.0)  # rows dominate: balance is worth it
    p = _auto(torch.tensor([[90, 10, 0, 0], [90, 10, 0, 0]]), 1, prev, cheap, "reference")
    assert p.choice.built_resident() and p.policy == "resident"


@given(st.data())
@settings(deadline=None)
def test_the_exit_builds_resident_only_where_it_could_pay_for_the_build(
    data: st.DataObject,
) -> None:
    """Where the exit skipped the ``resident`` build, that candidate charged the build
    would not have beaten the exit's plan (``bound.nocopy_s``)."""
    first = data.draw(counts(max_ranks=6, max_experts=14, max_records_per_rank=300))
    slots = data.draw(st.integers(1, first.shape[1]))
    cost = data.draw(costs())
    prev = moonplan.plan(counts_like(data, first), slots=slots)
    p = _auto(first, slots, prev, cost, "reference")
    held = bool((prev.slot_expert >= 0).any())
    if not (held and p.choice.early_exit()) or math.isfinite(p.choice.scores[RESIDENT]):
        return
    step = reference.Step(
        first.tolist(), slots, 1, prev.slot_expert.tolist(), previous_flows(prev.flow)
    )
    res, _ = reference.build(table()[RESIDENT], step, LEVELS, cost)
    mine = float(p.choice.scores[int(p.choice.index)])
    assert reference._time(cost, step, res, exit_build_s(cost)) >= mine


def test_chosen_plans_chain_as_previous_and_pickle() -> None:
    trace = DriftingTrace(8, 32, 2048, 4, seed=1, sigma=1.5, rho=0.9)
    prev, picked = None, set()
    for step in range(12):
        c = trace.step()
        cost = H200.scaled(copy_s_intra=H200.copy_s_intra * (0.05 if step % 3 else 30))
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


def test_policy_names_and_costs_are_checked() -> None:
    c = torch.tensor([[9, 1], [0, 4]])
    for bad in ("exact ", "bounded-0.1 ", "auto ", "level-0", "fastest", "", None, 3):
        with pytest.raises(PlanError):
            moonplan.plan(c, policy=bad)  # type: ignore[arg-type]
    for cost in (None, object(), {"plan_s": 1.0}):
        with pytest.raises(PlanError, match="StepCost"):
            moonplan.plan(c, policy="auto", cost=cost)  # type: ignore[arg-type]


@given(st.data())
def test_named_candidates_meet_their_bounds(data: st.DataObject) -> None:
    first = data.draw(counts(max_ranks=7, max_experts=16))
    R, E = first.shape
    slots = data.draw(st.none() | st.integers(0, min(-(-E // R) + 1, E)))
    prev = moonplan.plan(first, slots=slots)
    c = counts_like(data, first)
    for name in ("resident", "greedy", "placed", "level-1", "level-7", "bounded-0", "bounded-1.5"):
        ref = moonplan.plan(c, slots=slots, previous=prev, policy=name, backend="reference")
        got = moonplan.plan(c, slots=slots, previous=prev, policy=name)
        for k in PLAN_TENSORS:
            assert torch.equal(getattr(ref, k), getattr(got, k)), (name, k)
        assert got.policy == name and got.load_bound >= int(got.alloc.sum(0).max())
        check_plan(got, c, previous=prev)


@given(counts(max_ranks=7, max_experts=16), st.data())
def test_resident_moves_only_to_residents(c: torch.Tensor, data: st.DataObject) -> None:
    R, E = c.shape
    slots = data.draw(st.integers(0, min(-(-E // R) + 2, E)))
    prev = moonplan.plan(counts_like(data, c), slots=slots)
    p = moonplan.plan(c, slots=slots, previous=prev, policy="resident")
    assert p.new_copies() == 0 and p.summary()["direct"] == 0
    resident = {(e, r) for r, row in enumerate(prev.slot_expert.tolist()) for e in row if e >= 0}
    used = {(int(e), int(r)) for e, r in p.replica_mask().nonzero().tolist()}
    assert used <= resident
    static_R = moonplan.plan(c, policy="static").alloc.sum(0)
    assert int(p.alloc.sum(0).max()) <= int(static_R.max()) or not used


@given(counts(max_ranks=7, max_experts=16), st.data())
def test_placed_runs_each_expert_whole_on_its_lowest_slot_holder(
    c: torch.Tensor, data: st.DataObject
) -> None:
    R, E = c.shape
    slots = data.draw(st.integers(0, min(-(-E // R) + 2, E)))
    prev = moonplan.plan(counts_like(data, c), slots=slots)
    p = moonplan.plan(c, slots=slots, previous=prev, policy="placed")
    assert p.new_copies() == 0 and p.policy == "placed"
    home = home_list(E, R)
    rows = prev.slot_expert.tolist()
    holders = [[r for r, row in enumerate(rows) if e in row and r != home[e]] for e in range(E)]
    server = [min(holders[e]) if holders[e] else home[e] for e in range(E)]
    assert p.alloc.tolist() == [[int(c[:, e].sum()) if r == server[e] else 0 for r in range(R)]
                                for e in range(E)]  # fmt: skip
    check_plan(p, c, previous=prev)


@given(st.data())
def test_greedy_is_the_moonep_greedy_allocation_with_residents_kept(data: st.DataObject) -> None:
    first = data.draw(counts(max_ranks=7, max_experts=16))
    R, E = first.shape
    slots = data.draw(st.none() | st.integers(0, -(-E // R)))
    prev = moonplan.plan(first, slots=slots)
    c = counts_like(data, first)
    greedy = moonep_greedy_alloc(c)  # the baseline, written independently from the description
    for backend in ("reference", "torch"):
        p = moonplan.plan(c, slots=slots, previous=prev, policy="greedy", backend=backend)
        assert p.policy == "greedy" and torch.equal(p.alloc, greedy)
        check_plan(p, c, previous=prev)
        r_N, j_N = p.slot_new.nonzero(as_tuple=True)
        moved = {(int(p.slot_expert[r, j]), int(r)) for r, j in zip(r_N, j_N, strict=True)}
        old = {(e, r) for r, row in enumerate(prev.slot_expert.tolist()) for e in row if e >= 0}
        assert not (moved & old)  # a resident replica keeps its slot: only new ones move


def test_summary_and_predicted_report_the_choice() -> None:
    c = torch.tensor([[90, 1, 2, 3], [50, 0, 0, 1]])
    p = moonplan.plan(c, policy="auto", cost=H200)
    with pytest.raises(TypeError):
        p.predicted["static"] = 0.0  # type: ignore[index]
    s = p.summary()
    assert s["policy"] == p.policy and s["load_bound"] == p.load_bound
    assert s["predicted"] == dict(p.predicted) and math.isfinite(s["predicted"]["static"])
    exact = moonplan.plan(c)
    assert (exact.policy, dict(exact.predicted), exact.planned) == ("exact", {}, 1)


# Expert 0 (home rank 0) is resident on rank 1 and has a record from each rank; expert 1
# (home rank 1) one from rank 1. Rounded to records, expert 0 splits 1 / 1 and nothing is
# sent, but rank 1 runs two experts: two tiles. In whole tiles expert 0 stays home.
TILES_CASE = torch.tensor([[2, 0], [1, 1]])
TILES_PREV = torch.tensor([[0, 0], [40, 0]])  # its exact plan puts expert 0 on rank 1 too


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_resident_rounds_to_whole_tiles_where_the_cost_model_says_faster(backend: str) -> None:
    prev = moonplan.plan(TILES_PREV, slots=1)
    assert prev.slot_expert.tolist() == [[-1], [0]]
    compute, links = tiles_costs()
    want = {None: [[2, 1], [0, 1]], compute: [[3, 0], [0, 1]], links: [[2, 1], [0, 1]]}
    for cost, alloc in want.items():
        p = moonplan.plan(TILES_CASE, slots=1, previous=prev, policy="resident", cost=cost,
                          backend=backend)  # fmt: skip
        assert p.alloc.tolist() == alloc, cost
    for path in CPU_PATHS:  # auto's resident candidate, every form: one tile a rank, not 2
        scores = choose(TILES_CASE, 1, 1, prev, full(compute), path).choice.scores
        assert float(scores[2]) == float(scores[0]) == 16e-6, path
        scores = choose(TILES_CASE, 1, 1, prev, full(links), path).choice.scores  # none sent
        assert float(scores[2]) == 0.0 < float(scores[0]), path


def test_a_cost_that_is_not_a_step_cost_is_refused() -> None:
    with pytest.raises(PlanError, match="cost must be a StepCost"):
        moonplan.plan(TILES_CASE, policy="resident", cost="h200")  # type: ignore[arg-type]
