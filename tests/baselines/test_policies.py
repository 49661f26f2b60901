"""Baseline policies and metrics on small, hand-computed examples."""

from __future__ import annotations

import pytest
import torch

from moonplan.baselines import POLICY_NAMES, make_policy
from moonplan.baselines.capacity import CapacityPolicy, capacity_kept, capacity_per_source
from moonplan.baselines.eplb import (
    EPLBPolicy,
    balanced_packing,
    default_redundant,
    eplb_placement,
    placement_moves,
    replica_alloc,
    replicate,
)
from moonplan.baselines.metrics import (
    balancedness,
    balancedness_per_layer,
    balancedness_summed,
    expert_maxvio,
    imbalance,
    maxvio,
    step_metrics,
    summarize,
)
from moonplan.baselines.policies import split_pairs
from moonplan.baselines.prehistory import Prehistory
from moonplan.baselines.static_ep import StaticPolicy, round_robin_alloc
from moonplan.plan.placement import round_robin_home
from moonplan.stepcost import StepCost
from moonplan.traces import generate_counts
from tests.plan.choice.costs import rows_only
from tests.plan.draw import hot_steps

# the README's worked example: every record on rank 0, 8 experts on 4 ranks
WORKED_COUNTS = torch.tensor([[9, 1, 2, 0, 3, 5, 4, 8], [0] * 8, [0] * 8, [0] * 8])


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


# ---- metrics -------------------------------------------------------------------------------


def test_balance_metrics_by_hand() -> None:
    assert balancedness([8, 5]) == pytest.approx(6.5 / 8)
    assert imbalance([8, 5]) == pytest.approx(8 / 6.5)
    assert maxvio([8, 5]) == pytest.approx(8 / 6.5 - 1)
    assert balancedness([0, 0]) == 1.0 and imbalance([0, 0]) == 1.0 and maxvio([0, 0]) == 0.0
    layers = [[8, 5], [2, 2]]
    assert balancedness_per_layer(layers).tolist() == pytest.approx([0.8125, 1.0])
    assert balancedness_summed(layers) == pytest.approx((6.5 + 2) / (8 + 2))
    assert expert_maxvio(t([[3, 1], [1, 3], [2, 0]])) == pytest.approx(6 / 5 - 1)


def test_step_metrics_and_summary_of_static_ep() -> None:
    counts = t([[5, 1, 3, 0], [1, 1, 1, 1]])  # T = [6, 2, 4, 1]
    step = StaticPolicy(2, 4).step(counts)
    assert step.load_R.tolist() == [8, 5]
    m = step_metrics(step, expert_bytes=10.0)
    assert m["balancedness"] == pytest.approx(6.5 / 8)
    assert m["copies"] == 0 and m["moved_bytes"] == 0 and m["dropped_fraction"] == 0
    s = summarize([step, step])
    assert s["balancedness_summed"] == pytest.approx(6.5 / 8)
    with pytest.raises(ValueError):
        summarize([])


# ---- static placements -----------------------------------------------------------------------


def test_linear_and_round_robin_placements() -> None:
    counts = t([[5, 1, 3, 0], [1, 1, 1, 1]])
    assert round_robin_home(4, 2).tolist() == [0, 1, 0, 1]
    assert StaticPolicy(2, 4, "linear").step(counts).load_R.tolist() == [8, 5]
    rr = StaticPolicy(2, 4, "round-robin").step(counts)
    assert rr.load_R.tolist() == [10, 3]
    assert torch.equal(rr.alloc_ER, round_robin_alloc(counts))
    assert rr.name == "static-round-robin" and rr.new_copies == 0
    with pytest.raises(ValueError, match="placement"):
        StaticPolicy(2, 4, "random")


# ---- capacity --------------------------------------------------------------------------------


def test_capacity_drops_and_pads_by_hand() -> None:
    counts = t([[6, 2, 0, 0], [1, 1, 1, 1]])  # n_s = 8, 4 -> cap 2, 1 at factor 1
    assert capacity_per_source(counts, 1.0).tolist() == [2, 1]
    assert capacity_kept(counts, 1.0).tolist() == [[2, 2, 0, 0], [1, 1, 1, 1]]
    step = CapacityPolicy(2, 4, factor=1.0).step(counts)
    assert step.dropped == 4
    assert step.load_R.tolist() == [6, 2]  # real records: experts 0,1 -> 3 each; 2,3 -> 1 each
    assert step.rows_ER.sum(0).tolist() == [6, 6]  # padded: 3 rows for every expert
    assert step.sent_RE.tolist() == [[2, 2, 2, 2], [1, 1, 1, 1]]
    assert step_metrics(step)["dropped_fraction"] == pytest.approx(4 / 12)
    big = CapacityPolicy(2, 4, factor=1.25).step(counts)  # caps ceil(10/4)=3, ceil(5/4)=2
    assert big.dropped == 3 and big.name == "capacity-1.25"
    assert CapacityPolicy(2, 4, factor=2).name == "capacity-2.0"
    unpadded = CapacityPolicy(2, 4, factor=1.0, pad=False).step(counts)
    assert torch.equal(unpadded.rows_ER, unpadded.alloc_ER)


def test_capacity_uses_exact_rational_arithmetic() -> None:
    counts = torch.zeros(1, 100, dtype=torch.int64)
    counts[0, :80] = 1
    assert capacity_per_source(counts, 1.25).tolist() == [1]  # 1.25 * 80 / 100 is exactly 1
    with pytest.raises(ValueError):
        capacity_per_source(counts, 0.0)


# ---- EPLB ------------------------------------------------------------------------------------


def test_replicate_and_pack_by_hand() -> None:
    assert replicate([10, 1, 1, 4], 6) == [3, 1, 1, 1]
    assert replicate([1, 1, 1, 1], 6) == [2, 2, 1, 1]  # ties: lowest id
    assert balanced_packing([5, 4, 3, 3, 2, 1], 2) == [0, 1, 1, 0, 1, 0]
    with pytest.raises(ValueError):
        balanced_packing([1, 2, 3], 2)
    with pytest.raises(ValueError):
        replicate([1, 2, 3], 2)


def test_global_placement_and_even_split_by_hand() -> None:
    place = eplb_placement([10, 1, 1, 4], 2, 6)
    assert place.tolist() == [[0, 2, 3], [0, 0, 1]]
    alloc = replica_alloc(t([10, 1, 1, 4]), place)
    assert alloc.tolist() == [[4, 6], [0, 1], [1, 0], [4, 0]]  # expert 0: 10 -> 4, 3, 3
    assert alloc.sum(0).tolist() == [9, 7]


def test_hierarchical_placement_by_hand() -> None:
    place = eplb_placement([10, 1, 1, 4], 4, 8, nodes=2, groups=2)
    assert place.tolist() == [[0, 0], [0, 1], [3, 3], [2, 3]]
    # nodes that do not divide the groups fall back to the global policy
    assert torch.equal(
        eplb_placement([10, 1, 1, 4], 4, 8, nodes=2, groups=1), eplb_placement([10, 1, 1, 4], 4, 8)
    )


def test_eplb_policy_rebalances_from_history_every_period() -> None:
    """A rearrangement at step 2 plans from steps 0-1; its move is copied beside step 2
    (``spread`` 1), which still runs the old placement; the new one serves from step 3."""
    counts = t([[10, 1, 1, 4], [0, 0, 0, 0]])
    policy = EPLBPolicy(2, 4, redundant=2, period=2, window=2, spread=1)
    first = [policy.step(counts) for _ in range(2)]
    assert policy.place_RP.tolist() == [[0, 1, 2], [0, 1, 3]]  # planned from uniform loads
    assert all(s.new_copies == 0 for s in first)
    third = policy.step(counts)
    assert third.background_C2.tolist() == [[1, 0]]  # rank 0 fetches expert 3 from rank 1
    assert third.background_share == 1.0 and third.new_copies == 1
    assert third.moves_C2.shape == (0, 2) and third.copies == 2
    assert third.load_R.tolist() == [7, 9]  # the uniform placement: 5 + 1 + 1, 5 + 4
    fourth = policy.step(counts)  # the moved weights have arrived
    assert policy.place_RP.tolist() == [[0, 2, 3], [0, 0, 1]]
    assert fourth.load_R.tolist() == [9, 7] and fourth.new_copies == 0
    policy.reset()
    assert policy.t == 0 and not policy.history and policy.pending is None


def test_deployed_eplb_plans_from_its_window_by_hand() -> None:
    """Window 3, period 5, rearrangements at 4, 9, ...: the one at step 4 plans from steps
    1-3 only (mean loads [10, 2, 1, 4]: expert 0 gets 3 replicas of 10/3, packed heaviest
    first: [[0, 2, 3], [0, 0, 1]] by hand), its moves spread over the period (a fifth beside
    each of steps 4-8) and the placement serving from step 9."""
    steps = [[0, 0, 40, 0], [10, 1, 1, 4], [8, 3, 1, 4], [12, 2, 1, 4]]  # step 0 is outside
    policy = EPLBPolicy(2, 4, redundant=2, window=3, period=5, first=4)
    assert policy.spread == 5
    for loads in steps:
        policy.step(t([loads, [0, 0, 0, 0]]))
    quiet = t([[4, 4, 4, 4], [0, 0, 0, 0]])
    during = [policy.step(quiet) for _ in range(5)]  # steps 4-8
    assert all(s.background_share == 0.2 and s.background_C2.tolist() == [[1, 0]] for s in during)
    assert all(s.new_copies == pytest.approx(0.2) for s in during)
    assert policy.place_RP.tolist() == [[0, 1, 2], [0, 1, 3]]  # still the uniform placement
    policy.step(quiet)  # step 9: the moves have arrived
    assert policy.place_RP.tolist() == [[0, 2, 3], [0, 0, 1]]
    # the window of steps 0-3 would have planned another placement
    assert eplb_placement([7.5, 1.5, 10.75, 3.0], 2, 6).tolist() != [[0, 2, 3], [0, 0, 1]]


def test_eplb_prime_replays_the_steps_before_the_trace() -> None:
    """Deployed schedule in the middle of its period: the placement serving at step 0 is the
    one planned a period before the last rearrangement (its moves have arrived), and the
    last rearrangement's moves are in flight beside every step."""
    E, R = 4, 2
    policy = EPLBPolicy(R, E, redundant=2, window=2, period=6, first=3)  # r = -3, -9, ...
    assert policy.steps_before() == [(-11, -9), (-5, -3)]
    hot0, hot3 = [9, 1, 1, 1], [1, 1, 1, 9]
    before = Prehistory(t([-11, -10, -5, -4]), t([hot0, hot0, hot3, hot3]))
    policy.prime(before)
    step = policy.step(t([[3, 3, 3, 3], [0, 0, 0, 0]]))
    assert policy.place_RP.tolist() == eplb_placement(hot0, R, 6).tolist()
    pending = eplb_placement(hot3, R, 6)
    want = placement_moves(eplb_placement(hot0, R, 6), pending, ranks_per_node=2)
    assert step.background_C2.tolist() == want.tolist() and step.background_share == 1 / 6
    with pytest.raises(ValueError, match="reset"):
        policy.prime(before)


def test_eplb_respects_the_slots_it_is_given() -> None:
    assert EPLBPolicy(8, 64, slots=2).redundant == 16
    assert make_policy("eplb-fast", 8, 64, slots=3).redundant == 24
    assert make_policy("eplb", 8, 64, slots=None).redundant == 8  # one per GPU
    with pytest.raises(ValueError, match="disagree"):
        EPLBPolicy(8, 64, slots=2, redundant=8)
    fast = make_policy("eplb-fast", 8, 64, eplb_period=99)  # the deployed model's option
    assert (fast.period, fast.window, fast.spread) == (4, 4, 1)
    deployed = make_policy("eplb", 8, 64, period=2, eplb_period=30, eplb_window=10)
    assert (deployed.period, deployed.window, deployed.spread) == (30, 10, 30)


def test_eplb_arguments_and_defaults() -> None:
    assert default_redundant(256, 8) == 8
    assert default_redundant(8, 64) == 120  # 128 physical experts, 2 per rank
    assert EPLBPolicy(64, 8).redundant == 120
    with pytest.raises(ValueError, match="multiple"):
        EPLBPolicy(4, 8, redundant=1)
    with pytest.raises(ValueError):
        EPLBPolicy(4, 8, period=0)
    with pytest.raises(ValueError, match="spread"):
        EPLBPolicy(4, 8, period=4, spread=5)
    deployed = EPLBPolicy(8, 64)  # vLLM's EPLBConfig defaults
    assert (deployed.window, deployed.period, deployed.spread, deployed.first) == (
        1000,
        3000,
        3000,
        1000,
    )
    moves = placement_moves(t([[0, 1], [2, 3]]), t([[0, 2], [2, 3]]), ranks_per_node=1)
    assert moves.tolist() == [[1, 0]]


# ---- exact-balance policies ------------------------------------------------------------------


def test_greedy_and_moonplan_copies_and_moves() -> None:
    greedy = make_policy("moonep-greedy", 4, 8).step(WORKED_COUNTS)
    assert greedy.load_R.tolist() == [8, 8, 8, 8]
    assert greedy.copies == 2 and greedy.new_copies == 2
    home = greedy.moves_C2[:, 0].tolist()
    assert all(h != r for h, r in greedy.moves_C2.tolist()) and set(home) <= {0, 1, 2, 3}
    plain = make_policy("moonplan", 4, 8)
    assert plain.step(WORKED_COUNTS).new_copies == 2 and plain.step(WORKED_COUNTS).new_copies == 2
    resident = make_policy("moonplan-resident", 4, 8)
    assert resident.step(WORKED_COUNTS).new_copies == 2
    again = resident.step(WORKED_COUNTS)
    assert again.new_copies == 0 and again.copies == 2  # replicas already resident
    resident.reset()
    assert resident.step(WORKED_COUNTS).new_copies == 2


COST = StepCost.from_hardware("h200-node", "deepseek-v3")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_conserves_records(name: str) -> None:
    policy = make_policy(name, 4, 12, period=2, cost=COST)
    for seed in range(3):
        counts = generate_counts("lognormal", ranks=4, experts=12, tokens=40, topk=3, seed=seed)
        step = policy.step(counts)
        assert step.name == name
        assert int(step.alloc_ER.sum()) + step.dropped == int(counts.sum())
        assert torch.equal(step.rows_ER.sum(1), step.sent_RE.sum(0))
        assert bool((step.rows_ER >= step.alloc_ER).all())
        if not name.startswith("capacity"):
            assert step.dropped == 0 and torch.equal(step.alloc_ER.sum(1), counts.sum(0))


def test_make_policy_errors() -> None:
    assert make_policy("capacity-2", 2, 4).name == "capacity-2"
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("lpt", 2, 4)
    with pytest.raises(ValueError, match="capacity"):
        make_policy("capacity-x", 2, 4)
    with pytest.raises(ValueError):
        make_policy("capacity--1", 2, 4)
    with pytest.raises(ValueError):
        StaticPolicy(0, 4)
    with pytest.raises(ValueError, match="moonplan-auto needs cost"):
        make_policy("moonplan-auto", 2, 4)
    with pytest.raises(ValueError, match="moonplan-auto needs cost"):
        make_policy("moonplan-auto", 2, 4, cost="h200-node")


# ---- side-by-side comparison -----------------------------------------------------------------


def test_compare_policies_over_layers_by_hand() -> None:
    from moonplan.baselines.compare import compare_policies

    layer0 = t([[5, 1, 3, 0], [1, 1, 1, 1]])  # static loads [8, 5]
    layer1 = t([[1, 1, 1, 1], [1, 1, 1, 1]])  # static loads [4, 4]
    counts = torch.stack([layer0[None], layer1[None]])  # [L=2, T=1, R=2, E=4]
    rows = compare_policies(counts, ["static-linear", "moonplan"], expert_bytes=2.0)
    static, ours = rows
    assert static["balancedness_layer_min"] == pytest.approx(6.5 / 8)
    assert static["balancedness_layer_mean"] == pytest.approx((6.5 / 8 + 1) / 2)
    assert static["balancedness_summed"] == pytest.approx((6.5 + 4) / (8 + 4))
    assert ours["balancedness_summed"] == pytest.approx((6.5 + 4) / (7 + 4))  # [7, 6], [4, 4]
    assert ours["new_copies"] == 1 and ours["moved_bytes"] == 2.0
    with pytest.raises(ValueError):
        compare_policies(layer0, ["static-linear"])


# ---- moonplan-auto ---------------------------------------------------------------------------


def test_moonplan_auto_balances_when_copies_are_free_and_keeps_its_plan() -> None:
    auto = make_policy("moonplan-auto", 4, 8, cost=rows_only(plan_s=1e-6))
    first = auto.step(WORKED_COUNTS)
    assert first.choice == "exact" and first.load_R.tolist() == [8, 8, 8, 8]
    assert first.new_copies == 2 and first.planned == 1  # one planner call
    again = auto.step(WORKED_COUNTS)  # the chosen plan is `previous`: its replicas are resident
    assert again.load_R.tolist() == [8, 8, 8, 8] and again.new_copies == 0
    auto.reset()
    assert auto.step(WORKED_COUNTS).new_copies == 2


def test_moonplan_auto_stays_static_when_copies_cost_more_than_balance_saves() -> None:
    cost = rows_only(copy_s_intra=1.0, copy_s_inter=1.0, plan_s=1e-3, exit_s=1e-6)
    step = make_policy("moonplan-auto", 4, 8, cost=cost).step(WORKED_COUNTS)
    # the early exit: charged the test alone, as a share of one planner call
    assert step.choice == "static" and step.planned == pytest.approx(1e-3)
    assert step.new_copies == 0 and step.load_R.tolist() == [10, 2, 8, 12]
    assert step.fetch_ER is not None and not bool(step.fetch_ER.any())


@pytest.mark.parametrize(
    "name", ["moonep-greedy", "moonplan", "moonplan-resident", "moonplan-auto", "eplb"]
)
def test_fetched_pairs_are_the_critical_path_moves(name: str) -> None:
    """``fetch_ER``/``src_E`` (what StepCost charges) name exactly the ``moves_C2`` copies."""
    policy = make_policy(name, 8, 64, cost=rows_only(), period=2)
    moved = 0
    for seed in range(4):
        c = generate_counts("lognormal", ranks=8, experts=64, tokens=512, topk=4, sigma=1.5,
                            seed=seed)  # fmt: skip
        step = policy.step(c)
        if step.fetch_ER is None:
            assert step.moves_C2.shape[0] == 0 and name == "eplb"
            continue
        assert step.src_E is not None
        e_C, r_C = step.fetch_ER.nonzero(as_tuple=True)
        pairs = sorted(zip(step.src_E[e_C].tolist(), r_C.tolist(), strict=True))
        assert pairs == sorted(map(tuple, step.moves_C2.tolist()))
        assert bool((step.alloc_ER[step.fetch_ER] > 0).all())
        moved += len(pairs)
    assert (moved > 0) == (name != "eplb")


# ---- one planner seam: the simulator plans as the runtime does -------------------------------


@pytest.mark.parametrize(
    ("mode", "name"), [("exact", "moonplan-resident"), ("auto", "moonplan-auto")]
)
def test_simulator_plans_what_the_runtime_balancer_plans(mode: str, name: str) -> None:
    """``moonplan-resident`` and ``moonplan-auto`` and the runtime's ``Balancer`` make the
    same ``moonplan.plan(counts, previous=, policy=, cost=)`` call: the same plans step by
    step, and the simulator charges one planner call (or the early exit's: its test, and the
    resident candidate's build where the exit made it). Without staging rows auto refills nothing
    in the background (the runtime's ``Placer`` runs beside the ``Balancer``)."""
    from moonplan.runtime.balancer import Balancer

    cost = rows_only(copy_s_intra=1e-3, copy_s_inter=1e-3, plan_s=1e-3, exit_s=1e-5,
                     round_s=2e-5)  # fmt: skip
    sim = make_policy(name, 8, 64, cost=cost, slots=4, staging=0)  # no background refill
    runtime = Balancer(mode, slots=4, align=1, cost=cost if mode == "auto" else None)
    previous = None
    choices = set()
    for seed in range(10):
        c = generate_counts("lognormal", ranks=8, experts=64, tokens=256, topk=4, sigma=1.5,
                            seed=seed)  # fmt: skip
        step = sim.step(c)
        previous = runtime.plan(c, previous)
        assert torch.equal(step.alloc_ER, previous.alloc)
        assert step.new_copies == previous.new_copies()
        choice = previous.choice
        exited = choice is not None and choice.early_exit()
        rounds = int(choice.rounds) if choice is not None else 0
        charge = (1e-5 if exited else 1e-3) + 2e-5 * rounds  # each round the build ran
        assert (rounds > 0) == (choice.built_resident() if exited else mode == "auto")
        assert step.planned == pytest.approx(charge / 1e-3)
        choices.add(previous.policy)
    # auto's choice changes along the trace (a mixed trace, not one candidate throughout)
    assert choices == {"exact"} if mode == "exact" else len(choices) >= 2


def test_auto_reruns_and_resets_give_the_same_steps() -> None:
    cost = rows_only(copy_s_intra=1e-3, copy_s_inter=1e-3, plan_s=1e-3)
    trace = [generate_counts("lognormal", ranks=8, experts=64, tokens=256, topk=4, sigma=1.5,
                             seed=1 + i) for i in range(6)]  # fmt: skip
    for name in ("moonplan-auto",):
        policy = make_policy(name, 8, 64, cost=cost, slots=4, placement_window=3)
        runs = []
        for _ in range(2):
            policy.reset()
            runs.append([policy.step(c) for c in trace])
        fresh = make_policy(name, 8, 64, cost=cost, slots=4, placement_window=3)
        again = [fresh.step(c) for c in trace]
        for a, b, c in zip(*runs, again, strict=True):
            assert torch.equal(a.alloc_ER, b.alloc_ER) and torch.equal(a.alloc_ER, c.alloc_ER)
            assert (a.planned, a.choice) == (b.planned, b.choice) == (c.planned, c.choice)


def drifting(steps: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` lognormal count matrices ``[8, 64]`` (a new draw each step)."""
    return [generate_counts("lognormal", ranks=8, experts=64, tokens=256, topk=4, sigma=1.5,
                            seed=seed + i) for i in range(steps)]  # fmt: skip


# ---- moonplan-auto's slot placement: refilled beside the steps --------------------------------


def test_split_pairs_round_robin() -> None:
    pairs = torch.zeros(4, 3, dtype=torch.bool)
    pairs[0, 1] = pairs[1, 2] = pairs[2, 0] = pairs[3, 1] = pairs[3, 2] = True
    parts = split_pairs(pairs, 2)
    assert [int(p.sum()) for p in parts] == [3, 2]
    assert torch.equal(parts[0] | parts[1], pairs) and not bool((parts[0] & parts[1]).any())
    assert [int(p.sum()) for p in split_pairs(pairs, 7)] == [1] * 5 + [0, 0]


DEAR_COPIES = rows_only(copy_s_intra=3e-3, copy_s_inter=3e-3, plan_s=1e-6)
"""A copy costs 3000 rows: the hot set's excess pays for it over a few steps, not one."""


def persistent(steps: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` count matrices ``[8, 64]`` whose hot experts 0, 9 and 18 stay."""
    return hot_steps(steps, 8, 64, (0, 9, 18), low=20, high=40, extra=400, seed=seed)


def test_auto_refills_beside_the_steps_and_serves_once_copied() -> None:
    """A persistent hot set: the placement orders a refill (its copies beside the next
    steps, ``refill_ER``), swaps it in (``local_copies``) and then serves the hot experts'
    replicas without fetching them on the critical path; the step's planner call buys only
    what pays in that step (``rent=False``): a copy dearer than one step's gain, so the
    step's own call buys nothing and the rent pays the refill after a few steps."""
    policy = make_policy("moonplan-auto", 8, 64, cost=DEAR_COPIES, slots=4, placement_window=4)
    assert policy.slots == 4 and policy.staging == 1 and not policy.rent  # every slot serves
    steps = [policy.step(c) for c in persistent(24)]
    ordered = [i for i, s in enumerate(steps) if s.refill_ER is not None]
    swapped = [i for i, s in enumerate(steps) if s.local_copies]
    assert ordered and swapped and swapped[0] > ordered[0]
    from moonplan.plan.residency.serving import LOOKUPS

    # before: static EP, by a call or (no replica to balance with) a lookup of empty slots
    assert all(s.choice in ("static", *LOOKUPS) for s in steps[: ordered[0]])
    assert all(s.new_copies == 0 and s.planned == 0 for s in steps[2 : ordered[0]])
    assert all(s.choice == "resident" and s.new_copies == 0 for s in steps[swapped[0] :])
    assert all(s.local_copies <= 1 for s in steps)  # one staging row per rank
    held = policy._previous.slot_expert
    assert {0, 9, 18} & set(held[held >= 0].tolist())  # a hot expert is resident
    assert all(torch.equal(s.alloc_ER.sum(1), c.sum(0))
               for s, c in zip(steps, persistent(24), strict=True))  # fmt: skip


def test_auto_without_staging_rows_keeps_rent_or_buy() -> None:
    """Without staging rows nothing is refilled in the background and the step's call keeps
    buying for later steps."""
    policy = make_policy("moonplan-auto", 8, 64, cost=rows_only(), slots=1, staging=0)
    assert policy.residency is None and policy.rent and policy.slots == 1
    assert policy.steps_before() == [(-32, 0)]  # its own re-home reads the window
    no_rehome = make_policy("moonplan-auto", 8, 64, cost=rows_only(), slots=1, staging=0,
                            rehome=False)  # fmt: skip
    assert no_rehome.steps_before() == []
    steps = [policy.step(c) for c in persistent(4)]
    assert all(s.refill_ER is None and s.local_copies == 0 for s in steps)


def test_a_refill_waits_its_turn_with_the_other_layers() -> None:
    """The staging rows are shared by the model's layers: with 3 layers the refill waits
    for the other two first (each as long as its own copies), so it is copied and swapped
    in 2 n steps later than with one layer, and its copies are the same."""

    def run(layers: int) -> list:
        policy = make_policy("moonplan-auto", 8, 64, cost=DEAR_COPIES, slots=4,
                             placement_window=4, layers=layers)  # fmt: skip
        return [policy.step(c) for c in persistent(32)]

    one, three = run(1), run(3)
    copies = [[i for i, s in enumerate(r) if s.refill_ER is not None and s.refill_ER.any()]
              for r in (one, three)]  # fmt: skip
    swapped = [next(i for i, s in enumerate(r) if s.local_copies) for r in (one, three)]
    n = sum(1 for i in copies[0] if i < swapped[0])  # the steps of its own copies
    assert n >= 1
    assert copies[1][0] - copies[0][0] == 2 * n and swapped[1] - swapped[0] == 2 * n


def test_auto_primes_its_slots_from_the_steps_before() -> None:
    """Like EPLB's placement, the table serving at step 0 is the window's before the trace.
    (The exact way, free here as every call is, would keep no table: it is made dear.)"""
    from moonplan.baselines.prehistory import Prehistory

    cost = rows_only(exact_s=1.0)
    policy = make_policy(
        "moonplan-auto", 8, 64, cost=cost, slots=4, placement_window=4, rehome=False
    )  # slots in model ids (its re-home: test_auto_ordered)
    assert policy.steps_before() == [(-4, 0)]
    totals = torch.stack([c.sum(0) for c in persistent(4)])
    policy.prime(Prehistory(torch.arange(-4, 0), totals))
    held = policy._previous.slot_expert
    assert {0, 9, 18} <= set(held[held >= 0].tolist())
    step = policy.step(persistent(1, seed=5)[0])
    assert step.moves_C2.shape[0] == 0  # served from the primed slots: nothing fetched


def test_training_steps_leave_no_slot_resident_for_anyone() -> None:
    """``stale_slots`` (a training trace): the home weights change at every optimizer step.
    moonplan's policies plan without ``previous`` (every replica fetched again, no refill)
    and EPLB copies each redundant replica again from its first holder, both before the
    replicas' rows run."""
    trace = persistent(3)
    for name in ("moonplan-resident", "moonplan-auto"):
        opts = {"cost": rows_only(copy_s_intra=1e-9, copy_s_inter=1e-9)} if "auto" in name else {}
        policy = make_policy(name, 8, 64, slots=4, stale_slots=True, **opts)
        steps = [policy.step(c) for c in trace]
        assert all(s.new_copies == s.copies for s in steps[1:])  # nothing stays
        assert all(s.refill_ER is None for s in steps)
    eplb = make_policy("eplb", 8, 64, stale_slots=True)
    step = eplb.step(trace[0])
    assert 0 < step.moves_C2.shape[0] <= eplb.redundant  # a copy per replica beyond the first
    assert int(step.fetch_ER.sum()) == step.moves_C2.shape[0]
    kept = make_policy("eplb", 8, 64).step(trace[0])
    assert kept.moves_C2.shape[0] == 0  # inference: its replicas stay between re-placements


def test_auto_serves_a_lookup_without_calls_where_calls_cannot_pay() -> None:
    """A planner call dearer than any balance it buys (even loads over the window before
    the trace): each step is served by a lookup of the slots, charged no planning, with
    static EP's loads; with a hot expert, the steps call the planner that is free: ``auto``,
    or the exact kernel."""
    from moonplan.plan.residency.serving import LOOKUPS

    def even(steps: int) -> list[torch.Tensor]:
        return hot_steps(steps, 4, 16, (), low=20, high=22, extra=0)

    trace = even(6)
    totals = torch.stack([c.sum(0) for c in trace[:4]])
    dear = rows_only(exit_s=1e-3, plan_s=1e-3)
    auto = make_policy("moonplan-auto", 4, 16, cost=dear, slots=2, placement_window=4)
    auto.prime(Prehistory(torch.arange(-4, 0), totals))
    static = make_policy("static-linear", 4, 16)
    for c in trace[4:]:
        got, want = auto.step(c), static.step(c)
        assert got.choice in LOOKUPS and got.planned == 0
        assert got.load_R.tolist() == want.load_R.tolist()
    hot = torch.stack([c.sum(0) for c in hot_steps(4, 4, 16, (0,), low=20, high=22, extra=300)])
    for cost, way in ((rows_only(exact_s=1.0), "call"), (dear.scaled(exact_s=1e-9), "exact")):
        free = make_policy("moonplan-auto", 4, 16, cost=cost, slots=2, placement_window=4)
        free.prime(Prehistory(torch.arange(-4, 0), hot))
        assert free.decisions is not None and free.decisions.serve == way


def test_auto_serves_the_exact_kernel_where_it_is_predicted_fastest() -> None:
    """Where ``auto``'s call is dear and the exact kernel cheap, a hot expert's steps whose
    other loads swing (0-100 records, so no fixed split balances them) are served by the
    exact kernel with ``previous=`` (``moonplan-resident``'s plans, step for step), each
    charged one exact call, not ``auto``'s. On steady loads the weighted lookup's fixed
    shares balance as well, with no call, and serve (``test_weighted_lookup_...``)."""
    trace = hot_steps(8, 4, 16, (0,), low=0, high=100, extra=300)
    cost = rows_only(exit_s=1e-3, plan_s=1e-3, exact_s=1e-5)
    auto = make_policy("moonplan-auto", 4, 16, cost=cost, slots=2, placement_window=4)
    auto.prime(Prehistory(torch.arange(-4, 0), torch.stack([c.sum(0) for c in trace[:4]])))
    resident = make_policy("moonplan-resident", 4, 16, slots=2)
    for c in trace[4:]:
        got, want = auto.step(c), resident.step(c)
        assert got.choice == "exact" and got.planned == pytest.approx(1e-5 / 1e-3)
        assert torch.equal(got.alloc_ER, want.alloc_ER)


def test_weighted_lookup_serves_a_steady_hot_expert_with_no_call() -> None:
    """A steady hot expert (other loads 20-21) with the exact kernel cheap and ``auto``'s
    call dear: the decision's fixed shares balance each step as the exact kernel would,
    with no call, so the weighted lookup serves, charged nothing, its busiest rank within
    1% of the exact kernel's (the shares are fixed; the noise is not)."""
    trace = hot_steps(8, 4, 16, (0,), low=20, high=22, extra=300)
    cost = rows_only(exit_s=1e-3, plan_s=1e-3, exact_s=1e-5)
    auto = make_policy("moonplan-auto", 4, 16, cost=cost, slots=2, placement_window=4)
    auto.prime(Prehistory(torch.arange(-4, 0), torch.stack([c.sum(0) for c in trace[:4]])))
    exact = make_policy("moonplan-resident", 4, 16, slots=2)
    static = make_policy("static-linear", 4, 16)
    for c in trace[4:]:
        got, best, worst = auto.step(c), exact.step(c), static.step(c)
        assert got.choice == "weighted" and got.planned == 0
        assert got.load_R.max() <= 1.01 * best.load_R.max() < worst.load_R.max()
