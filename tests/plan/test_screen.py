"""The screen of ``policy="auto"``: step 1's flows from counts alone, and what they bound."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moonplan
from moonplan.plan.choose import Inputs, balancing_order, build
from moonplan.plan.screen import Floors, Step
from moonplan.stepcost import StepCost, plan_fetch_ER
from moonplan.testing import counts
from moonplan.traces import DriftingTrace
from tests.plan.draw import counts_like


@given(st.data())
def test_the_screen_sees_the_flows_and_at_most_the_pairs_the_plan_makes(
    data: st.DataObject,
) -> None:
    first = data.draw(counts(max_ranks=7, max_experts=16, max_records_per_rank=300))
    R, E = first.shape
    slots = data.draw(st.none() | st.integers(0, -(-E // R)))
    prev = moonplan.plan(first, slots=slots) if data.draw(st.booleans()) else None
    c = counts_like(data, first)
    B = -(-E // R) if slots is None else slots
    prev_RB = None if prev is None else prev.slot_expert
    inp = Inputs(c, B, 1, prev_RB, None if prev is None else prev.flow, "torch")
    load = build("static", inp).alloc.sum(0).tolist()
    for name, target, _ in balancing_order(load, None):
        p = build(name, inp)
        view = Floors.of(c, target, inp.prev_RB, inp.prev_F3)
        flows = [f for f in p.flow.tolist() if f[0] >= 0]
        assert view.flow_F3.tolist() == flows, name  # step 1, without building the plan
        fetch_ER = plan_fetch_ER(p)
        for (d, r, _), pairs, copies in zip(flows, view.pairs_F, view.copies_F, strict=True):
            mine_E = p.home == d
            assert int(((p.alloc[:, r] > 0) & mine_E).sum()) >= pairs, (name, d, r)
            assert int((fetch_ER[:, r] & mine_E).sum()) >= copies, (name, d, r)


def test_decode_steps_keep_static_and_build_almost_nothing() -> None:
    # DeepSeek-V3 on one H200 node at 16 tokens per rank: a replica adds a weight read
    # and a copy outlasts the step, so static (or resident) wins every step; the flows'
    # floors rule out every balancing candidate but one close call (exact within 1% of
    # static before its planner run), where one construction is made
    cost = StepCost.from_hardware("h200-node", "deepseek-v3")
    trace = DriftingTrace(8, 256, 16, 8, seed=0, sigma=1.0, rho=0.99)
    prev, runs = None, 0
    for _ in range(6):
        p = moonplan.plan(trace.step(), previous=prev, policy="auto", cost=cost)
        assert p.policy in ("static", "resident"), dict(p.predicted)
        runs += p.planned
        prev = p
    assert runs <= 1


def test_prefill_steps_still_balance() -> None:
    cost = StepCost.from_hardware("h200-node", "deepseek-v3")
    c = DriftingTrace(8, 256, 4096, 8, seed=0, sigma=1.0, rho=0.99).step()
    p = moonplan.plan(c, policy="auto", cost=cost)
    assert p.policy == "exact" and p.planned == 1
    assert torch.equal(p.alloc, moonplan.plan(c).alloc)


def test_a_choice_copies_the_previous_flows_to_the_host_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every screened candidate reads the previous flows from the choice's shared
    :class:`Step` (one host copy), and a step shared that way bounds as one built alone."""
    from moonplan.plan import screen
    from moonplan.plan.choose import choose, screened_order

    cost = StepCost.from_hardware("h200-node", "deepseek-v3")
    trace = DriftingTrace(8, 64, 512, 8, seed=1, sigma=1.5)
    c0, c = trace.step(), trace.step()
    prev = moonplan.plan(c0)
    inp = Inputs(c, prev.num_slots, 1, prev.slot_expert, prev.flow, "torch")
    order = screened_order(inp.static_load, inp)
    assert len(order) >= 2  # several candidates screened
    shared = Step.of(c, prev.slot_expert, prev.flow)
    for _, target, _ in order:
        alone = Floors.of(c, target, prev.slot_expert, prev.flow)
        view = Floors.of(c, target, prev.slot_expert, prev.flow, step=shared)
        assert view.flow_F3.tolist() == alone.flow_F3.tolist()
        assert view.copies_F.tolist() == alone.copies_F.tolist()
    copies: list[int] = []
    real = screen.previous_flows
    monkeypatch.setattr(screen, "previous_flows", lambda f: copies.append(1) or real(f))
    choose(inp, cost)
    assert copies == [1]


@given(st.data())
def test_a_shared_step_bounds_as_a_fresh_one_and_reads_previous_once(data: st.DataObject) -> None:
    """``Step`` reads ``previous``'s slots once: its warm pairs are the construction's
    (``group_flows.warm_maps``), and the tile- and domain-sized parts it keeps for later
    bounds give every bound the same float as a step built for that bound alone."""
    from moonplan.plan.group_flows import warm_maps
    from moonplan.plan.screen import lower_bound

    first = data.draw(counts(max_ranks=9, max_experts=20, max_records_per_rank=300))
    R, E = first.shape
    prev = moonplan.plan(first) if data.draw(st.booleans()) else None
    c = counts_like(data, first)
    prev_RB = None if prev is None else prev.slot_expert
    prev_F3 = None if prev is None else prev.flow
    shared = Step.of(c, prev_RB, prev_F3)
    assert shared.warm == warm_maps(prev_RB, shared.home)[0]
    inp = Inputs(c, -(-E // R), 1, prev_RB, prev_F3, "torch")
    load = build("static", inp).alloc.sum(0).tolist()
    tile = data.draw(st.sampled_from([1, 16, 128]))
    domain = data.draw(st.integers(0, R))
    cost = StepCost.from_hardware("h200-node", "deepseek-v3").scaled(tile_rows=tile, domain=domain)
    for replay in (True, False):
        for _, target, _ in balancing_order(load, None):
            kw = dict(target=target, prev_RB=prev_RB, prev_F3=prev_F3, horizon=8.0, replay=replay)
            alone = lower_bound(cost, c, 0, **kw)  # type: ignore[arg-type]
            again = lower_bound(cost, c, 0, step=shared, **kw)  # type: ignore[arg-type]
            assert alone == again
