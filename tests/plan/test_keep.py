"""``policy="auto"`` keeping its previous choice (``moonplan.plan.keep``) and charging its work.

Legend: R ranks, E experts; ``load`` the static loads (records of each rank's home experts).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given

import moonplan
from moonplan.plan import keep
from moonplan.plan.choose import WORK, Inputs, build
from moonplan.plan.keep import keeps, record_s, refresh_every
from moonplan.plan.plan_type import Basis, Plan
from moonplan.stepcost import StepCost
from moonplan.testing import counts
from moonplan.traces import DriftingTrace
from tests.plan.test_policy import H200

MULTI = StepCost.from_hardware("h200-multinode", "deepseek-v3")


def _inputs(c: torch.Tensor, prev: Plan) -> Inputs:
    return Inputs(c, prev.num_slots, 1, prev.slot_expert, prev.flow, "torch", prev.policy,
                  prev.basis)  # fmt: skip


def _skewed(R: int = 8, E: int = 64, S: int = 64) -> torch.Tensor:
    return DriftingTrace(R, E, S, 8, sigma=1.0, seed=3).step()


@given(counts(max_ranks=6, max_experts=14, max_records_per_rank=300))
def test_the_same_counts_keep_the_choice_until_the_refresh(c: torch.Tensor) -> None:
    cost = H200.scaled(plan_s=H200.plan_s / 200)  # full choices every few steps
    p = moonplan.plan(c, policy="auto", cost=cost)
    assert p.basis is not None and p.basis.kept == 0 and p.predicted
    assert p.chose >= WORK["setup"] + WORK["score"]  # one fixed candidate scored at least
    best = p.predicted[p.policy]
    assert p.basis.every == refresh_every((p.planned + p.chose) * cost.plan_s, best)
    first = p
    if p.basis.every > 6:
        return  # checked by hand below
    for step in range(1, p.basis.every):  # kept, then the full choice again
        q = moonplan.plan(c, previous=p, policy="auto", cost=cost)
        if first.basis.gap_s <= 0:  # nothing to keep by: every step chooses
            assert q.basis is not None and q.basis.kept == 0 and q.predicted
            return
        assert q.policy == first.policy and q.basis is not None
        assert q.basis.kept == step and q.basis.load == first.basis.load
        assert q.chose == WORK["keep"] and not q.predicted
        assert q.planned == (0 if q.policy in ("static", "resident") else 1)
        ref = build(q.policy, _inputs(c, p))  # the candidate, built for these counts
        assert torch.equal(q.alloc, ref.alloc) and torch.equal(q.slot_expert, ref.slot_expert)
        p = q
    again = moonplan.plan(c, previous=p, policy="auto", cost=cost)
    assert again.basis is not None and again.basis.kept == 0 and again.predicted


def test_keeps_up_to_the_tolerance_and_not_beyond() -> None:
    c = _skewed()
    p = moonplan.plan(c, policy="auto", cost=H200)
    load = p.static_load().tolist()
    per = record_s(H200, 8)
    assert per is not None and per > 0
    moved = [x + (3 if r == 0 else 0) for r, x in enumerate(load)]  # rank 0: 3 more records
    for gap_s, kept in ((2 * 3 * per * (1 + 1e-9), True), (2 * 3 * per * (1 - 1e-9), False)):
        prev = dataclasses.replace(p, basis=Basis(tuple(load), gap_s, every=2))
        assert keeps(_inputs(c, prev), moved, H200) is kept
    prev = dataclasses.replace(p, basis=Basis(tuple(load), 1.0, kept=7, every=8))  # choose
    assert not keeps(_inputs(c, prev), load, H200)
    prev = dataclasses.replace(p, basis=Basis(tuple(load), 1.0, kept=6, every=8))  # keep
    assert keeps(_inputs(c, prev), load, H200)
    assert not keeps(_inputs(c, dataclasses.replace(p, basis=None)), load, H200)
    assert not keeps(_inputs(c, dataclasses.replace(p, basis=Basis(tuple(load), 0.0))), load, H200)


def test_refresh_every_bounds_the_full_choices_share() -> None:
    assert refresh_every(0.0, 1e-3) == 1 and refresh_every(1e-4, 0.0) == 1
    for full_s, best_s in ((2.5e-4, 6.5e-4), (4e-4, 6.8e-3), (1e-6, 1.0)):
        n = refresh_every(full_s, best_s)
        assert full_s / n <= keep.REFRESH_SHARE * best_s * (1 + 1e-12)
        assert n == 1 or full_s / (n - 1) > keep.REFRESH_SHARE * best_s


def test_record_s_uses_the_link_classes_the_ranks_use() -> None:
    one, many = record_s(MULTI, 8), record_s(MULTI, 64)  # one node vs across nodes
    assert one is not None and many is not None and many > one
    flop_mem = MULTI.row_flop_s + MULTI.row_mem_s
    assert one == pytest.approx(flop_mem + MULTI.dispatch_row_s_intra + MULTI.combine_row_s_intra)
    assert record_s(object(), 8) is None  # a cost model without the rates never keeps


def test_decode_choice_is_cheap_on_average() -> None:
    """At decode sizes (DeepSeek-V3, EP8, 16 tokens per rank) the choice is kept between full
    choices, so its work averages well below one full choice per step."""
    R, E = 8, 256
    trace = DriftingTrace(R, E, 16, 8, sigma=1.0, rho=0.99, seed=0).steps(16)
    prev, work = None, []
    for c in trace[:16]:
        prev = moonplan.plan(c, previous=prev, policy="auto", cost=H200)
        work.append(prev.planned + prev.chose)
    full = [w for w in work if w > WORK["keep"] + 1]
    assert len(full) < len(work) / 2, work
    assert sum(work) / len(work) < sum(full) / len(full) / 2, work
