"""The lean choose-ahead search (``moonplan.plan.search``) against ``choose``'s built plans.

Legend: R ranks, E experts, B slots; counts int64 ``[R, E]``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import moonplan
from moonplan.plan.choose import CANDIDATES, TABLE, WORK, Candidate, Inputs, build, choose
from moonplan.plan.plan_type import PLAN_TENSORS, Plan
from moonplan.plan.score_alloc import Context, fetched_pairs
from moonplan.plan.screen import Step
from moonplan.plan.search import Choice, search
from moonplan.stepcost.step_cost import plan_fetch_ER
from moonplan.testing import counts
from tests.plan.draw import counts_like
from tests.plan.test_policy import COMPUTE_ONLY, H200, costs

SMALL = counts(max_ranks=6, max_experts=14, max_records_per_rank=300)
ADVERSARIAL = counts(max_ranks=6, max_experts=14, max_records_per_rank=300,
                     families=("hot", "zero", "uniform"))  # fmt: skip


def _inputs(c: torch.Tensor, B: int, align: int, prev: Plan | None, backend: str) -> Inputs:
    if prev is None:
        return Inputs(c, B, align, None, None, backend)
    return Inputs(c, B, align, prev.slot_expert, prev.flow, backend, prev.policy, prev.basis)


def _fields(x: Plan | Choice) -> tuple:
    return x.policy, dict(x.predicted), x.planned, x.chose, x.basis


def _same_plan(a: Plan, b: Plan) -> None:
    for k in PLAN_TENSORS:
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert (*_fields(a), a.load_bound) == (*_fields(b), b.load_bound)


@st.composite
def chains(draw: st.DrawFn, strategy: st.SearchStrategy[torch.Tensor] = SMALL) -> tuple:
    """``(counts of 3 steps, B, align, cost, backend)``: a layer's steps, some repeated."""
    first = draw(strategy)
    R, E = first.shape
    M = -(-E // R)
    B = draw(st.sampled_from([M, 0, 1, min(M + 1, E)]))
    align = draw(st.sampled_from([1, 4]))
    steps = [first]
    data = draw(st.data())
    for _ in range(2):
        again = draw(st.booleans())  # the same counts: auto may keep its choice
        steps.append(steps[-1] if again else counts_like(data, first))
    return steps, B, align, draw(costs()), draw(st.sampled_from(["torch", "reference"]))


@given(chains(SMALL) | chains(ADVERSARIAL))
def test_search_names_what_choose_chooses(chain: tuple) -> None:
    """Every step of a chain of inline ``auto`` plans: the search on the same inputs gives
    the same policy, scores, runs, work and basis (a kept step: no run)."""
    steps, B, align, cost, backend = chain
    prev = None
    for c in steps:
        inp = _inputs(c, B, align, prev, backend)
        built = choose(inp, cost, lean=False)  # every scored candidate built and scored
        found = search(inp, cost)
        kept = built.chose == WORK["keep"]
        assert _fields(found) == (*_fields(built)[:2], 0 if kept else built.planned,
                                  *_fields(built)[3:])  # fmt: skip
        prev = built


@given(chains(SMALL) | chains(ADVERSARIAL))
def test_lean_choose_builds_the_same_plan_bit_for_bit(chain: tuple) -> None:
    steps, B, align, cost, backend = chain
    prev = None
    for c in steps:
        inp = _inputs(c, B, align, prev, backend)
        lean, full = choose(inp, cost), choose(inp, cost, lean=False)
        _same_plan(lean, full)
        prev = lean


@given(chains(SMALL) | chains(ADVERSARIAL))
def test_fetched_pairs_are_the_built_plans_fetch(chain: tuple) -> None:
    """For every candidate, from any previous plan (slot budgets below ``M``: direct reads;
    residents the new allocation does not use: evicted), the pairs computed from the
    allocation and the previous slots are those the built plan fetches."""
    steps, B, align, cost, backend = chain
    prev = moonplan.plan(steps[0], slots=B, align=align, policy="auto", cost=cost)
    for c in steps[1:]:
        for prev_of in (prev, None):
            inp = _inputs(c, B, align, prev_of, backend)
            for name in CANDIDATES:
                if name == "resident" and prev_of is None:
                    continue
                p = build(name, inp)
                got = fetched_pairs(p.alloc, inp.prev_RB)
                assert torch.equal(torch.from_numpy(got), plan_fetch_ER(p)), name
        prev = moonplan.plan(c, slots=B, align=align, previous=prev, policy="exact")


def _same_context(a: Context, b: Context) -> None:
    for f in dataclasses.fields(Context):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        elif isinstance(x, dict):  # the host scans walk them: in the same order too
            assert x == y and repr(x) == repr(y), f.name
        elif f.name == "prev":  # the tensors as given (the reference builder reads them)
            assert all(u is v for u, v in zip(x, y, strict=True))
        else:
            assert x == y, f.name


@given(chains(SMALL) | chains(ADVERSARIAL))
def test_context_from_the_screen_step_equals_context_of(chain: tuple) -> None:
    """``Context.of_step`` (the lean choice's one host view, ``screen.Step``) equals
    ``Context.of`` (its own reading of the counts and previous), field by field, with
    and without a previous plan, its slots alone or with its flows."""
    steps, B, align, cost, _ = chain
    prev = moonplan.plan(steps[0], slots=B, align=align, policy="auto", cost=cost)
    for c in steps[1:]:
        for prev_RB, prev_F3 in ((None, None), (prev.slot_expert, None),
                                 (prev.slot_expert, prev.flow)):  # fmt: skip
            want = Context.of(c, prev_RB, prev_F3)
            _same_context(Context.of_step(Step.of(c, prev_RB, prev_F3), prev_RB, prev_F3), want)
        prev = moonplan.plan(c, slots=B, align=align, previous=prev, policy="auto", cost=cost)


def test_direct_reads_and_evictions_are_fetched_pairs() -> None:
    """Both, written out: R=3, E=12 (4 experts a rank), one slot. Rank 0 gives 20 records
    to rank 1 from two of its experts (10 each): one takes rank 1's slot, evicting the
    resident expert 9 it no longer uses, the other is a direct read. Both are fetched."""
    c = torch.zeros(3, 12, dtype=torch.int64)
    c[0, :4] = 10  # rank 0's home experts 0-3: 40 records
    c[2, 8:10] = 10  # rank 2's experts 8, 9: 20 records; exact targets 20 each
    prev_RB = torch.tensor([[-1], [9], [-1]])
    want = torch.zeros(12, 3, dtype=torch.bool)
    want[0, 1] = want[1, 1] = True
    for backend in ("torch", "reference"):
        for name in ("exact", "greedy"):
            p = build(name, Inputs(c, 1, 1, prev_RB, None, backend))
            assert p.slot_expert[1].tolist() == [0] and p.slot_new[1].tolist() == [1]
            assert p.direct_expert()[1].tolist()[:1] == [1]
            got = torch.from_numpy(fetched_pairs(p.alloc, prev_RB))
            assert torch.equal(got, want) and torch.equal(plan_fetch_ER(p), want)


def test_a_kept_step_builds_nothing_and_says_so() -> None:
    c = torch.tensor([[90, 2, 1, 1, 0, 3, 2, 1]] * 4)
    cost = H200.scaled(plan_s=H200.plan_s * 100)  # full choices every few steps
    p = moonplan.plan(c, policy="auto", cost=cost)
    assert p.basis is not None and p.basis.every > 1
    inp = _inputs(c, p.num_slots, 1, p, "torch")
    inline = choose(inp, cost)
    found = search(inp, cost)
    assert inline.chose == found.chose == WORK["keep"]  # the same counts: kept
    assert found.planned == 0 and found.policy == inline.policy == p.policy
    assert found.basis == inline.basis and found.basis.kept == p.basis.kept + 1
    assert dict(found.predicted) == {}


def test_a_candidate_without_construct_is_built_to_score_it() -> None:
    """A table entry whose allocation is not the construction (``construct=False``) is
    scored from its built plan: the same choice as with the entry marked."""
    calls = []
    exact = next(c for c in TABLE if c.name == "exact")

    def counted(inp: Inputs) -> Plan:
        calls.append(1)
        return exact.build(inp)

    table = tuple(
        dataclasses.replace(c, build=counted, construct=False) if c.name == "exact" else c
        for c in TABLE
    )
    c = torch.tensor([[90, 2, 1, 1, 0, 3, 2, 1]] * 4)
    inp = _inputs(c, 2, 1, None, "torch")
    found = search(inp, COMPUTE_ONLY, table)
    assert _fields(found) == _fields(search(inp, COMPUTE_ONLY))
    assert found.policy == "exact" and calls == [1]  # built once, to score it
    assert all(isinstance(t, Candidate) for t in table)


def test_the_bench_times_both_paths_and_names_the_search_choice() -> None:
    """``bench/bench_search.py`` on one small case, one repetition: its row reports the
    search's own choice and the charged work it divides by."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from bench_search import case, markdown

    row = case(8, 16, reps=1)
    assert row["picks"] in CANDIDATES and row["kept"]
    assert row["us_per_work"] == row["full"]["search"] / (row["planned"] + row["chose"])
    assert set(row["full"]) == {"choose", "search", "lean_choose", "construct"}
    assert row["keep_ratio"] > 0 and len(markdown([row], 1)) == 6


@given(chains(SMALL) | chains(ADVERSARIAL), st.floats(0.0, 16.0))
def test_a_work_budget_narrows_the_search_to_a_prefix(chain: tuple, budget: float) -> None:
    """``search(..., budget=)``: the full search's scores for the candidates it still
    scores (the same build order, the same runs), no more work than the budget beyond
    the setup and the fetch-free scores, ``cut`` the candidates it left out, no lead
    (never kept) when it cut any, and the full search itself when the budget covers it."""
    steps, B, align, cost, backend = chain
    prev = None
    for c in steps:
        inp = _inputs(c, B, align, prev, backend)
        full, cut = search(inp, cost), search(inp, cost, budget=budget)
        if full.basis is None or not full.predicted:  # a kept step: no full choice to cut
            assert cut == full
        else:
            assert cut.predicted.items() <= full.predicted.items()
            assert min(cut.predicted.values()) == cut.predicted[cut.policy]
            floor = WORK["setup"] + WORK["score"] * len(cut.predicted)
            assert cut.planned + cut.chose <= max(budget, floor) + 1e-9
            if full.planned + full.chose <= budget:
                assert cut == full
            if cut.cut:
                assert cut.basis is not None and cut.basis.gap_s == 0.0
            else:
                assert (cut.policy, cut.predicted) == (full.policy, full.predicted)
        prev = choose(inp, cost)


def test_a_tight_budget_keeps_the_fetch_free_candidates() -> None:
    """With no room for any balancing candidate the search still scores static (and
    resident where slots exist) and names the best of them; the cut is reported."""
    c = torch.tensor([[90, 1, 1, 1, 30, 0], [80, 2, 0, 1, 0, 40]])
    inp = _inputs(c, 2, 1, None, "torch")
    full, cut = search(inp, COMPUTE_ONLY), search(inp, COMPUTE_ONLY, budget=0.0)
    assert full.policy not in ("static", "resident")  # copies free: a balancing one wins
    assert len(full.predicted) > len(cut.predicted) >= 1 and cut.cut > 0
    assert "static" in cut.predicted and cut.planned == 0
    assert cut.policy in ("static", "resident")
