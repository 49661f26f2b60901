"""``auto``'s rent-or-buy rule: its two forms agree, and a chain of steps buys copies
once their rent is paid, never before.

Legend: R ranks, E experts, C candidates.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moonplan
from moonplan import check_plan
from moonplan.plan.choice import PATHS, choose, reference
from moonplan.plan.choice.bound import MARGIN, experts_lb_s
from moonplan.plan.choice.rent import exit_rent, exit_rent_torch, settle, settle_torch
from moonplan.plan.choice.table import LEVELS, table
from moonplan.plan.reference import previous_flows
from moonplan.testing import counts
from tests.plan.choice.costs import H200, costs
from tests.plan.draw import counts_like

# few distinct values, so that ties and equal rents and prices are drawn often
SECONDS = st.sampled_from([0.0, 1e-6, 2e-6, 3e-6, 1e-5, 0.5, 1.0])

CPU_PATHS = tuple(p for p in PATHS if p != "cuda")  # the kernel: test_choice_kernel_*.py


def _f64(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


@given(st.lists(st.tuples(SECONDS, SECONDS), min_size=1, max_size=8), SECONDS, st.booleans())
def test_settle_forms_agree(pairs: list[tuple[float, float]], credit: float, odd: bool) -> None:
    """``odd``: free scores above the scores (sections the model overlaps) are allowed."""
    free = [f for f, _ in pairs]
    scores = [f + extra * (-1 if odd else 1) for f, extra in pairs]
    index, after = settle(scores, free, credit)
    got = settle_torch(
        torch.tensor(scores, dtype=torch.float64),
        torch.tensor(free, dtype=torch.float64),
        _f64(credit),
    )
    assert (int(got[0]), float(got[1])) == (index, after)
    best = min(scores)
    b, c = scores.index(best), free.index(min(free))
    if index != b:  # a buy: the least free score's plan, paid for by the credit and the rent
        assert after == 0.0 and index == c
        assert scores[index] - best <= credit + (best - free[index])
    else:
        assert after in (0.0, credit + max(0.0, best - free[c]))


@given(
    SECONDS, st.sampled_from([-1e-6, 0.0, 2e-6, 0.5]), SECONDS, SECONDS, SECONDS, SECONDS, SECONDS
)
def test_exit_rent_forms_agree(
    t: float, gap: float, b0: float, b1: float, credit: float, pending: float, checking: float
) -> None:
    exited, after, owed = exit_rent(t, gap, (b0, b1), (credit, pending), checking)
    x = (_f64(t), _f64(gap), (_f64(b0), _f64(b1)), (_f64(credit), _f64(pending)), checking)
    got = exit_rent_torch(*x)
    assert (bool(got[0]), float(got[1]), float(got[2])) == (exited, after, owed)
    if exited:
        assert after == credit + max(0.0, gap) and after < b1 - t  # no buy is due
        assert owed == pending + max(0.0, t - b0)
        assert t <= b0 or owed < checking  # above the bound only until a call is paid for
    else:  # a full call the bound alone would have skipped is rent; every call clears pending
        assert after == credit + (checking if t <= b0 else 0.0) and owed == 0.0


def test_a_call_above_the_bound_waits_until_it_could_have_paid() -> None:
    """The exit's plan is 3 us above the bound each step and a full call costs 10 us more
    than the test: the exit keeps its plan three steps (3, 6, 9 us owed) and calls on the
    fourth (12 us), which clears what is owed."""
    credit, pending, seen = -math.inf, 0.0, []
    for _ in range(5):
        exited, credit, pending = exit_rent(13e-6, 0.0, (10e-6, 1.0), (credit, pending), 10e-6)
        seen.append((exited, round(pending * 1e6, 6)))
        credit = -math.inf  # rent=False: no buy is ever due
    assert seen == [(True, 3.0), (True, 6.0), (True, 9.0), (False, 0.0), (True, 3.0)]


def test_within_the_bound_nothing_is_owed() -> None:
    """An exit plan within the bound carries ``pending`` as it is: nothing a call could save."""
    assert exit_rent(1e-6, 0.0, (2e-6, 1.0), (0.0, 4e-6), 10e-6) == (True, 0.0, 4e-6)


@given(st.data())
@settings(deadline=None)
def test_experts_lb_is_below_every_candidate(data: st.DataObject) -> None:
    """``experts_lb``, the exit's rent estimate's floor, bounds every candidate's experts
    phase, with or without its copies charged."""
    first = data.draw(counts(max_ranks=6, max_experts=14, max_records_per_rank=300))
    R, E = first.shape
    slots = data.draw(st.integers(0, E))
    cost = data.draw(costs())
    prev = moonplan.plan(counts_like(data, first), slots=slots)
    step = reference.Step(
        first.tolist(), slots, 1, prev.slot_expert.tolist(), previous_flows(prev.flow)
    )
    lb = experts_lb_s(cost, R, *reference._totals(cost, step.counts))
    for k in table():
        alloc, _ = reference.build(k, step, LEVELS)
        for free in (False, True):
            assert reference._step_time(cost, step, alloc, 0.0, free).experts_s >= lb * MARGIN


def _skewed(R: int, E: int) -> torch.Tensor:
    """One persistently hot expert: its home rank runs many times the mean."""
    c = torch.full((R, E), 40, dtype=torch.int64)
    c[:, 0] = 4000
    return c


def test_buys_once_the_rent_is_paid() -> None:
    """Copies too dear for one step but cheap against the steps they serve: static EP
    while the rent accrues, one buy when it covers the price, then the replicas serve.
    Every form takes the same steps."""
    c = _skewed(4, 8)
    cost = H200.scaled(copy_s_intra=4e-3)  # a copy: about 4 ms; the skew: about 1.6 ms a step
    chains: dict[str, list[tuple[str, int]]] = {}
    for path in CPU_PATHS:
        prev, steps = None, []
        for _ in range(8):
            p = choose(c, 2, 1, prev, cost, path)
            check_plan(p, c, previous=prev)
            steps.append((p.policy, p.new_copies()))
            prev = p
        chains[path] = steps
    assert chains["host"] == chains["reference"] == chains["tensor"]
    steps = chains["host"]
    first = next(i for i, (_, n) in enumerate(steps) if n > 0)
    assert first >= 1  # the first step does not buy: one step's rent is below the price
    assert all(name == "static" for name, _ in steps[:first]), steps
    assert all(n == 0 and name != "static" for name, n in steps[first + 1 :]), steps  # they serve


def test_credit_accrues_and_resets() -> None:
    c = _skewed(4, 8)
    cost = H200.scaled(copy_s_intra=4e-3)
    p = moonplan.plan(c, slots=2, policy="auto", cost=cost)
    assert p.policy == "static" and 0.0 < float(p.choice.credit) < math.inf
    q = moonplan.plan(c, slots=2, previous=p, policy="auto", cost=cost)
    bought = q.policy != "static"
    assert float(q.choice.credit) == (0.0 if bought else float(q.choice.credit))
    if not bought:
        assert float(q.choice.credit) > float(p.choice.credit)  # the rent adds up
    exact = moonplan.plan(c, slots=2, previous=p)  # a plan made without auto carries none
    r = moonplan.plan(c, slots=2, previous=exact, policy="auto", cost=cost)
    assert float(r.choice.credit) <= float(p.choice.credit) + 1e-12 or r.policy != "static"


def test_uniform_counts_accrue_no_rent() -> None:
    c = torch.full((4, 8), 100, dtype=torch.int64)
    prev = None
    for _ in range(4):
        prev = moonplan.plan(c, slots=2, previous=prev, policy="auto", cost=H200)
        assert prev.policy == "static" and float(prev.choice.credit) == 0.0


def test_a_full_call_above_the_bound_waits_until_it_could_have_paid() -> None:
    """Skewed counts, copies that would pay, and a full call far dearer than the exit's test:
    the exit keeps static EP while what a call could have saved (its distance above the
    bound, summed) stays below the call's price, then calls once, and ``pending`` returns
    to 0. Every form takes the same steps."""
    c = _skewed(4, 8)
    cost = H200.scaled(plan_s=2e-3, exit_s=1e-6)  # static EP: 0.33 ms above the bound
    checking = cost.plan_s - cost.exit_s
    chains: dict[str, list[tuple[bool, float]]] = {}
    for path in CPU_PATHS:
        prev, steps = None, []
        for _ in range(8):
            p = choose(c, 2, 1, prev, cost, path, rent=False)
            steps.append((p.choice.early_exit(), float(p.choice.pending)))
            prev = p
        chains[path] = steps
    assert chains["host"] == chains["reference"] == chains["tensor"]
    steps = chains["host"]
    call = next(i for i, (exited, _) in enumerate(steps) if not exited)
    over = steps[0][1]  # the first exit's distance above the bound
    assert call >= 2 and 0.0 < over < checking
    assert [p for _, p in steps[:call]] == pytest.approx([over * (i + 1) for i in range(call)])
    assert steps[call][1] == 0.0 and over * (call + 1) >= checking * (1 - 1e-12)
