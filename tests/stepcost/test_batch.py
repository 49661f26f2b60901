"""``batch_step_time``: many allocations at once, equal to ``StepCost.step_time`` bit for bit."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonplan.plan.home import home_map
from moonplan.stepcost import StepCost
from moonplan.stepcost.batch import batch_step_time
from moonplan.testing import counts

FIELDS = ("plan_s", "prefetch_s", "prefetch_exposed_s", "dispatch_s", "experts_s",
          "combine_s", "total_s")  # fmt: skip


@st.composite
def allocations(draw: st.DrawFn, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An allocation of ``c``'s records over its ranks, and fetched pairs among them."""
    R, E = c.shape
    T = c.sum(0).tolist()
    alloc = torch.zeros(E, R, dtype=torch.int64)
    for e in range(E):
        cuts = sorted(draw(st.lists(st.integers(0, T[e]), min_size=R - 1, max_size=R - 1)))
        alloc[e] = torch.tensor([b - a for a, b in zip([0, *cuts], [*cuts, T[e]], strict=True)])
    bits = draw(st.lists(st.booleans(), min_size=E * R, max_size=E * R))
    return alloc, torch.tensor(bits).reshape(E, R) & (alloc > 0)


@st.composite
def costs(draw: st.DrawFn) -> StepCost:
    rate = st.floats(0.0, 1e-4, allow_nan=False)
    return StepCost(
        *(draw(rate) for _ in range(9)),
        base_latency_s=draw(rate),
        per_peer_latency_s=draw(rate),
        tile_rows=draw(st.sampled_from([1, 3, 8, 128])),
        domain=draw(st.integers(0, 5)),
        overlap=draw(st.booleans()),
    )


@given(counts(max_ranks=9, max_experts=12), st.data())
@settings(deadline=None)
def test_equals_step_time_bit_for_bit(c: torch.Tensor, data: st.DataObject) -> None:
    cost = data.draw(costs())
    drawn = [data.draw(allocations(c)) for _ in range(3)]
    plan_C = torch.tensor([0.0, 1e-5, 3.7e-6], dtype=torch.float64)
    R, E = c.shape
    home = home_map(E, R)
    got = batch_step_time(
        cost,
        c,
        torch.stack([a for a, _ in drawn]),
        torch.stack([f for _, f in drawn]),
        home,
        plan_C,
    )
    for i, (alloc, fetch) in enumerate(drawn):
        want = cost.scaled(plan_s=float(plan_C[i])).step_time(alloc, c, fetch, home, planned=1)
        for f in FIELDS:
            assert float(getattr(got, f)[i]) == getattr(want, f), (i, f)


@given(counts(max_ranks=9, max_experts=12), st.data())
@settings(deadline=None, max_examples=50)
def test_several_charges_score_like_one_each(c: torch.Tensor, data: st.DataObject) -> None:
    """``plan_C`` of shape ``[P, C]``: row ``p`` of each charged field is the batch scored
    with ``plan_C[p]`` alone; the other fields do not depend on the charge."""
    cost = data.draw(costs())
    drawn = [data.draw(allocations(c)) for _ in range(3)]
    alloc = torch.stack([a for a, _ in drawn])
    fetch = torch.stack([f for _, f in drawn])
    plan_PC = torch.tensor([[0.0, 1e-5, 3.7e-6], [2e-6, 0.0, 5e-7]], dtype=torch.float64)
    home = home_map(c.shape[1], c.shape[0])
    got = batch_step_time(cost, c, alloc, fetch, home, plan_PC)
    for p in range(2):
        want = batch_step_time(cost, c, alloc, fetch, home, plan_PC[p])
        for f in FIELDS:
            g = getattr(got, f)
            assert torch.equal(g[p] if g.dim() == 2 else g, getattr(want, f)), (p, f)


@given(counts(max_ranks=9, max_experts=12), st.data())
@settings(deadline=None, max_examples=50)
def test_nothing_fetched_scores_as_all_false(c: torch.Tensor, data: st.DataObject) -> None:
    """``fetch_CER=None`` (the fast path without copies) gives every field's floats of an
    all-false fetch mask."""
    cost = data.draw(costs())
    alloc = torch.stack([data.draw(allocations(c))[0] for _ in range(3)])
    plan_C = torch.tensor([0.0, 1e-5, 3.7e-6], dtype=torch.float64)
    home = home_map(c.shape[1], c.shape[0])
    got = batch_step_time(cost, c, alloc, None, home, plan_C)
    want = batch_step_time(cost, c, alloc, torch.zeros_like(alloc, dtype=torch.bool), home, plan_C)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
