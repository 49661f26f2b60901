"""The runtime's placer: ``balance="auto"`` orders refills from the residency, alike on every rank.

Legend: R ranks, E experts, B slots, T tokens (all ranks), H hidden, F ffn, K top-k.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

import moonplan
from moonplan.plan.residency.refill import Decisions, Residency
from moonplan.runtime.placer import Placer, decision_worker
from moonplan.runtime.staging import StagingPool
from moonplan.stepcost import StepCost
from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_moe, dense_weights, split, tokens
from tests.runtime.test_refill import _hold

H, F, K, TIMEOUT = 8, 12, 2, 120.0


def _cost() -> StepCost:
    """Weight reads nearly free and no tile padding (a replica pays for the balance it buys),
    and a copy dearer than one step's gain: a step buys none itself, the residency's rent
    pays a refill."""
    cost = StepCost.from_hardware("h200-node", "deepseek-v3", plan_us=20.0, exit_us=1.0)
    return cost.scaled(copy_s_intra=5e-6, copy_s_inter=5e-6, weight_read_s=1e-9, tile_rows=1)


def _hot(R: int, E: int, seed: int) -> torch.Tensor:
    c = torch.randint(5, 15, (R, E), generator=torch.Generator().manual_seed(seed))
    c[:, 1] += 300
    return c


def _pool() -> StagingPool:
    return StagingPool({"gate_up": torch.zeros(1, 2, 2), "down": torch.zeros(1, 2, 1)})


class _Ticket:
    """A layer's refill stand-in (the pool holds its line weakly)."""


def test_the_placer_waits_for_a_cost_model_and_for_a_refill_in_flight() -> None:
    """No cost model, slots or staging: nothing. While a refill is in flight the steps are
    observed and no decision starts; a decision starts from one step and its answer is
    used ``due`` steps later (here 1), on the decision worker in between."""
    pool, me = _pool(), _Ticket()
    p0 = moonplan.plan(_hot(4, 8, 0), slots=2, policy="static")
    assert Placer(2, 1).after_step(_hot(4, 8, 0), p0, None, False, pool, me) is None
    assert not Placer(0, 1).active(_cost()) and not Placer(2, 0).active(_cost())
    placer = Placer(2, 1)
    got = [placer.after_step(_hot(4, 8, s), p0, _cost(), True, pool, me) for s in range(5)]
    assert got == [None] * 5 and placer.residency is not None
    assert placer.residency.window.filled == 5  # busy steps are still observed
    assert placer.after_step(_hot(4, 8, 9), p0, _cost(), False, pool, me) is None  # starts
    target = placer.after_step(_hot(4, 8, 10), p0, _cost(), False, pool, me)  # its answer
    assert target is not None and int((target == 1).sum()) >= 1  # the hot expert
    assert placer.orders == 1 and placer.waiting is None and pool.waiting() == []
    order = placer.decisions.ordered if placer.decisions else None
    assert order is not None
    assert torch.equal(torch.where(order.changed_RB, order.slot_RB, -1), target)
    placer.arrived(order.slot_RB)  # committed: its table serves the way judged for it
    assert placer.serve() == order.serve and placer.decisions.ordered is None
    placer.arrived(order.slot_RB)  # a table no decision judged now: planner calls
    assert placer.serve() == "call"
    placer.close()


def test_an_order_waits_its_turn_for_the_shared_staging_rows() -> None:
    """While another layer's refill holds the rows, the ordered refill waits in line (no
    decision starts meanwhile) and is handed over at the first step after the rows are
    given back; a layer whose slots go stale (no cost model) leaves the line."""
    pool, me, other = _pool(), _Ticket(), _Ticket()
    p0 = moonplan.plan(_hot(4, 8, 0), slots=2, policy="static")
    placer = Placer(2, 1)
    placer.after_step(_hot(4, 8, 0), p0, _cost(), False, pool, me)  # a decision starts
    pool.acquire(other)
    assert placer.after_step(_hot(4, 8, 1), p0, _cost(), False, pool, me) is None
    assert placer.orders == 1 and placer.waiting is not None and pool.waiting() == [me]
    for s in range(2, 6):  # waiting: observed, nothing decided, nothing handed over
        assert placer.after_step(_hot(4, 8, s), p0, _cost(), False, pool, me) is None
    assert placer.orders == 1 and placer.residency is not None
    assert placer.residency.window.filled == 6
    want = placer.waiting
    pool.release(other)
    target = placer.after_step(_hot(4, 8, 6), p0, _cost(), False, pool, me)
    assert target is not None and torch.equal(target, want)
    assert placer.waiting is None and pool.waiting() == []
    placer.after_step(_hot(4, 8, 7), p0, _cost(), False, pool, me)  # the next decision
    pool.acquire(other)
    placer.after_step(_hot(4, 8, 8), p0, _cost(), False, pool, me)
    assert placer.orders == 2 and pool.waiting() == [me]
    assert placer.after_step(_hot(4, 8, 9), p0, None, False, pool, me) is None  # stale
    assert placer.waiting is None and pool.waiting() == []
    placer.close()


def test_every_layer_decides_on_one_worker_thread() -> None:
    """The layers' decisions run one after another on the process's one worker (the
    simulator's charge bounds that queue: docs/simulator.md)."""
    threads = set()

    def where() -> int:
        return threading.get_ident()

    for _ in range(3):
        threads.add(decision_worker().submit(where).result())
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert decision_worker() is decision_worker()


def _worker_in_child(rank: int, world: int) -> str:
    return decision_worker().submit(threading.current_thread).result(timeout=30).name


def test_a_forked_rank_gets_its_own_decision_worker() -> None:
    """The ranks are forked from this process, which made its worker above: a child must
    not submit to the parent's thread (it is not in the child, and would never run)."""
    decision_worker().submit(int).result()
    names = run_ranks(_worker_in_child, 2, timeout=TIMEOUT)
    assert all(name.startswith("moonplan-placer") for name in names)


def test_a_waiting_order_is_not_handed_over_while_a_refill_is_in_flight() -> None:
    """A refill requested by hand while an order waits goes first: the order is handed over
    only once nothing of this layer is in flight."""
    pool, me, other = _pool(), _Ticket(), _Ticket()
    p0 = moonplan.plan(_hot(4, 8, 0), slots=2, policy="static")
    placer = Placer(2, 1)
    placer.after_step(_hot(4, 8, 0), p0, _cost(), False, pool, me)
    pool.acquire(other)
    assert placer.after_step(_hot(4, 8, 1), p0, _cost(), False, pool, me) is None
    pool.release(other)
    assert placer.waiting is not None
    assert placer.after_step(_hot(4, 8, 2), p0, _cost(), True, pool, me) is None
    assert placer.after_step(_hot(4, 8, 3), p0, _cost(), False, pool, me) is not None
    placer.close()


_BEFORE_FORK: dict[str, Placer] = {}


def _decide_in_child(rank: int, world: int) -> int:
    decisions = _BEFORE_FORK["placer"].decisions
    assert decisions is not None and decisions.submit is not None
    return decisions.submit(lambda: 7).result(timeout=30)  # type: ignore[arg-type, return-value]


def test_a_placer_made_before_a_fork_decides_in_the_child() -> None:
    """A placer that decided in the parent submits, in a forked rank, to the child's own
    worker (the parent's thread is not in the child: a job sent to it would never run)."""
    pool, me = _pool(), _Ticket()
    p0 = moonplan.plan(_hot(4, 8, 0), slots=2, policy="static")
    placer = Placer(2, 1)
    placer.after_step(_hot(4, 8, 0), p0, _cost(), False, pool, me)  # decides here
    placer.close()
    _BEFORE_FORK["placer"] = placer
    assert run_ranks(_decide_in_child, 2, timeout=TIMEOUT) == [7, 7]


def _serve(
    rank: int,
    world: int,
    E: int,
    transport: str,
    cost: StepCost | None = None,
    train: bool = False,
    swing: bool = False,
) -> dict:
    """Twelve steps of an ``auto`` layer whose expert 1 is every token's first choice
    (``swing``: on every other step only, the others routed at random, so no fixed split
    balances both kinds of step), each checked against the dense oracle."""
    from moonplan import MoonMoE

    sizes = [40 + 4 * r for r in range(world)]
    T = sum(sizes)
    w = dense_weights(E, H, F, seed=3)
    g = torch.Generator().manual_seed(11)
    plain = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids = plain.clone()
    ids[:, 0] = 1  # a persistent hot expert: every token's first choice
    ids[:, 1] = torch.where(ids[:, 1] == 1, 2, ids[:, 1])
    wk = torch.softmax(torch.randn(T, K, generator=g), -1)
    offset = sum(sizes[:rank])
    kinds = [ids, plain] if swing else [ids]
    step = [0]

    def route(x_SH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, now = x_SH.shape[0], kinds[step[0] % len(kinds)]
        return now[offset : offset + n], wk[offset : offset + n] * (1 + 0 * x_SH.sum())

    layer = MoonMoE(H, F, E, K, slots=2, router=route, balance="auto", cost=cost or _cost(),
                    transport=transport, max_tokens=64)  # fmt: skip
    layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
    x = split(tokens(T, H, 5), sizes)[rank]
    ws = {n: w[n].double() for n in ("gate_up", "down")}
    wants = [split(dense_moe(tokens(T, H, 5).double(), i, wk, ws), sizes)[rank] for i in kinds]
    errs, choices = [], []
    down = next(p for n, p in layer.named_parameters() if n.endswith("down_proj"))
    with torch.no_grad():
        for _ in range(12):
            y = layer(x)
            errs.append(float((y.double() - wants[step[0] % len(kinds)]).abs().max()))
            step[0] += 1
            choices.append(layer.last_stats.choice)
            if train:  # an optimizer step's in-place update (values kept): slots go stale
                down.mul_(1.0)
    rt = layer.runtime
    out = {"errs": errs, "orders": rt.placer.orders, "commits": rt.refill.commits,
           "slots": layer.last_plan.slot_expert.tolist(), "serve": rt.placer.serve(),
           "policy": layer.last_stats.policy, "choice": layer.last_stats.choice,
           "choices": choices, "weights": _weights(rt.placer)}  # fmt: skip
    rt.close()
    return out


def _weights(placer: Any) -> list[list[int]] | None:
    """The weighted lookup's weights serving now (``None``: another way serves)."""
    shares = placer.shares(False, torch.device("cpu"))
    return None if shares is None else shares.weight_ER.tolist()


def test_auto_refills_a_persistent_hot_expert_and_still_equals_the_oracle() -> None:
    for transport in ("heap", "a2a"):
        got = run_ranks(_serve, 2, 6, transport, timeout=TIMEOUT)
        assert got[0]["orders"] == got[1]["orders"] >= 1, got
        assert got[0]["commits"] == got[1]["commits"] >= 1, got
        assert got[0]["slots"] == got[1]["slots"]  # the same table on every rank
        assert 1 in {e for row in got[0]["slots"] for e in row}  # the hot expert stays
        assert max(max(g["errs"]) for g in got) < 1e-4, got


def test_auto_serves_a_lookup_where_calls_cannot_pay_and_equals_the_oracle() -> None:
    """A planner call dearer than the hot expert's imbalance costs: after the first decision
    the steps serve the slots' weighted lookup without a call (fixed shares fit to the
    window: the hot expert is every token's first choice, so they balance it), with the
    same weights on every rank, and still equal the oracle."""
    # (a decision's host work at its own rates: unmeasured, it would be charged exit_s)
    dear = _cost().scaled(exit_s=1.0, plan_s=1.0, decide_s=1e-9, score_s=1e-9)
    for transport in ("heap", "a2a"):
        got = run_ranks(_serve, 2, 6, transport, dear, timeout=TIMEOUT)
        assert got[0]["serve"] == got[1]["serve"] == "weighted", got
        assert got[0]["policy"] == got[1]["policy"] == "weighted", got
        assert got[0]["choice"] == got[1]["choice"] == "lookup", got
        assert got[0]["weights"] == got[1]["weights"] is not None, got
        assert max(max(g["errs"]) for g in got) < 1e-4, got


def test_the_balancer_serves_every_lookup_as_the_plans_say() -> None:
    """``Balancer.serve`` serves each way as its plan function does, reading nothing on
    the host: the even lookups (``lookup_plan``), the weighted one with the decision's
    weights (``weighted_plan``), and static EP over no slots."""
    from moonplan.plan.residency.serving import LOOKUPS, lookup_plan, serving_plan, weighted_plan
    from moonplan.plan.residency.shares import Shares
    from moonplan.runtime.balancer import Balancer

    g = torch.Generator().manual_seed(2)
    counts_RE = torch.randint(0, 50, (4, 8), generator=g)
    counts_RE[:, 0] += 200
    slot_RB = torch.tensor([[-1, -1], [0, -1], [0, 7], [1, -1]])
    previous = serving_plan(counts_RE, slot_RB)
    shares = Shares(torch.randint(0, 9, (8, 4), generator=g))
    bal = Balancer("auto", slots=2, align=1)
    for how in LOOKUPS:
        want = lookup_plan(counts_RE, slot_RB, how)
        assert torch.equal(bal.serve(counts_RE, previous, how).alloc, want.alloc)
    want = weighted_plan(counts_RE, slot_RB, shares)
    got = bal.serve(counts_RE, previous, "weighted", shares)
    assert torch.equal(got.alloc, want.alloc) and got.requested == "weighted"
    assert torch.equal(got.alloc.sum(1), counts_RE.sum(0))
    static = moonplan.plan(counts_RE, slots=2, policy="static")
    assert torch.equal(bal.serve(counts_RE, None, "split").alloc, static.alloc)


def test_auto_serves_the_exact_kernel_where_it_is_fastest_and_equals_the_oracle() -> None:
    """``auto``'s call dear, the exact kernel nearly free, and a hot expert that comes and
    goes (no fixed split balances both kinds of step): after the first decision the steps
    are the exact plan with ``previous=`` (``StepStats.choice`` ``"exact"``), alike on
    every rank, and equal the oracle."""
    cheap = _cost().scaled(exit_s=1.0, plan_s=1.0, exact_s=1e-9, decide_s=1e-9, score_s=1e-9)
    for transport in ("heap", "a2a"):
        got = run_ranks(_serve, 2, 6, transport, cheap, swing=True, timeout=TIMEOUT)
        assert got[0]["serve"] == got[1]["serve"] == "exact", got
        assert got[0]["choice"] == got[1]["choice"] == "exact", got
        assert got[0]["policy"] == got[1]["policy"] == "exact", got
        assert got[0]["slots"] == got[1]["slots"]
        assert max(max(g["errs"]) for g in got) < 1e-4, got


def test_stale_slots_serve_the_way_judged_for_stale_steps() -> None:
    """Weights changed at every step (training): no slot stays, so the decisions judge the
    way of such steps (no refill): here the exact kernel from empty slots, the steps equal
    the oracle, alike on every rank, and nothing is refilled."""
    cheap = _cost().scaled(exit_s=1.0, plan_s=1.0, exact_s=1e-9, decide_s=1e-9, score_s=1e-9)
    got = run_ranks(_serve, 2, 6, "heap", cheap, True, timeout=TIMEOUT)
    assert got[0]["choices"] == got[1]["choices"] and got[0]["choices"][-1] == "exact", got
    assert got[0]["orders"] == got[1]["orders"] == 0, got
    assert max(max(g["errs"]) for g in got) < 1e-4, got


def _two_auto_layers(rank: int, world: int, transport: str) -> dict:
    """Two ``auto`` layers of one shape (one set of staging rows), each with its own
    persistent hot expert: both order a refill. The first's is reported in flight for six
    more steps once copied (``_hold``), so the second's order comes while the first holds
    the rows: it waits its turn and commits after the first; both equal their oracles."""
    from moonplan import MoonMoE

    E, sizes = 6, [40 + 4 * r for r in range(world)]
    T, offset = sum(sizes), sum(sizes[:rank])
    w = dense_weights(E, H, F, seed=3)
    g = torch.Generator().manual_seed(11)
    x, wants, layers, trace = split(tokens(T, H, 5), sizes)[rank], [], [], []
    # decisions counted nearly free: the turns, not the decisions' lag, are under test
    quick = _cost().scaled(decide_s=1e-9, score_s=1e-9)
    for hot in (1, 4):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        ids[:, 1] = torch.where(ids[:, 0] == hot, ids[:, 1], ids[:, 0])
        ids[:, 0] = hot  # every token's first choice
        ids[:, 1] = torch.where(ids[:, 1] == hot, (hot + 1) % E, ids[:, 1])
        wk = torch.softmax(torch.randn(T, K, generator=g), -1)

        def route(x_SH: torch.Tensor, ids=ids, wk=wk) -> tuple[torch.Tensor, torch.Tensor]:
            n = x_SH.shape[0]
            return ids[offset : offset + n], wk[offset : offset + n] * (1 + 0 * x_SH.sum())

        layer = MoonMoE(H, F, E, K, slots=2, router=route, balance="auto", cost=quick,
                        transport=transport, max_tokens=64)  # fmt: skip
        layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
        layers.append(layer)
        ws = {n: w[n].double() for n in ("gate_up", "down")}
        wants.append(split(dense_moe(tokens(T, H, 5).double(), ids, wk, ws), sizes)[rank])
    errs = []
    _hold(layers[0].runtime, 6)
    with torch.no_grad():
        for _ in range(20):
            for layer, want in zip(layers, wants, strict=True):
                errs.append(float((layer(x).double() - want).abs().max()))
            a, b = (layer.runtime for layer in layers)
            trace.append((a.refill.commits, b.refill.commits, b.placer.waiting is not None,
                          a.refill.in_flight))  # fmt: skip
    out = {"errs": max(errs), "trace": trace,
           "slots": [layer.last_plan.slot_expert.tolist() for layer in layers]}  # fmt: skip
    for layer in layers:
        layer.runtime.close()
    return out


def test_two_auto_layers_take_turns_and_both_refill() -> None:
    for transport in ("heap", "a2a"):
        got = run_ranks(_two_auto_layers, 2, transport, timeout=TIMEOUT)
        assert got[0]["trace"] == got[1]["trace"] and got[0]["slots"] == got[1]["slots"]
        trace = got[0]["trace"]
        waited = [s for s, (_, _, waiting, _) in enumerate(trace) if waiting]
        assert waited and all(trace[s][3] for s in waited), trace  # only while the first holds
        assert trace[-1][0] >= 1 and trace[-1][1] >= 1, trace  # both committed
        first_b = next(s for s, t in enumerate(trace) if t[1] >= 1)
        assert trace[first_b][0] >= 1  # the second commits after the first
        for hot, slots in zip((1, 4), got[0]["slots"], strict=True):
            assert hot in {e for row in slots for e in row}
        assert max(g["errs"] for g in got) < 1e-4, got


def test_the_placer_copies_a_verdicts_shares_to_the_device_once() -> None:
    """``Placer.shares`` hands the step the weighted verdict's shares on the step's device,
    the same copy every step until another verdict comes; none where another way serves."""
    from moonplan.plan.residency.refill import Verdict
    from moonplan.plan.residency.shares import Shares

    placer = Placer(2, 1)
    res = Residency(4, 8, 2, _cost())
    placer.decisions = Decisions(res)
    assert placer.shares(False, torch.device("cpu")) is None  # no verdict: calls
    first = Shares(torch.ones(8, 4, dtype=torch.int64))
    res.primed = Verdict(None, "weighted", shares=first)
    got = placer.shares(False, torch.device("cpu"))
    assert got is not None and torch.equal(got.weight_ER, first.weight_ER)
    assert placer.shares(False, torch.device("cpu")) is got  # copied once
    assert placer.shares(True, torch.device("cpu")) is None  # judged for slots that stay
    res.primed = Verdict(None, "weighted", shares=Shares(2 * first.weight_ER))
    assert placer.shares(False, torch.device("cpu")) is not got  # a new verdict: its copy
