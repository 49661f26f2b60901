"""moonplan.plan.ahead: the lagged choice is inline auto's choice one step back (``L`` back
with a lag: ``search_lag``, ``AheadChoice``).

Legend: R ranks, E experts, ``counts_RE`` int64 ``[R, E]``.
"""

import math

import pytest
import torch

from moonplan.cost import get_preset
from moonplan.plan import plan
from moonplan.plan.ahead import (
    FORECAST_CHOICES,
    MAX_LAG,
    AheadChoice,
    choose_next,
    inline_choice,
    search_lag,
)
from moonplan.plan.choose import WORK
from moonplan.stepcost import StepCost


def _cost() -> StepCost:
    return StepCost.from_hardware("h200-node", get_preset("deepseek-v3"))


def _trace(steps: int, R: int = 8, E: int = 32, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` skewed count matrices ``[R, E]`` (64 records per rank)."""
    g = torch.Generator().manual_seed(seed)
    pop_E = torch.rand(E, generator=g) ** 4 + 0.01
    out = []
    for _ in range(steps):
        ids = torch.multinomial(pop_E, R * 64, replacement=True, generator=g).reshape(R, 64)
        out.append(torch.stack([torch.bincount(row, minlength=E) for row in ids]))
    return out


def test_first_step_is_inline_then_named():
    ahead, cost = AheadChoice(), _cost()
    assert ahead.policy() == "auto"
    c0 = _trace(1)[0]
    p0 = plan(c0, policy=ahead.policy(), cost=cost, backend="torch")
    assert ahead.update(c0, p0, previous=None, cost=cost) is None  # that search was its own
    assert ahead.policy() == plan(c0, policy="auto", cost=cost, backend="torch").policy
    assert ahead.before is p0 and not ahead.searching


def test_choice_is_inline_auto_one_step_back():
    cost, ahead = _cost(), AheadChoice()
    prev = None
    for counts in _trace(5, seed=1):
        named = ahead.policy() != "auto"
        p = plan(counts, previous=prev, policy=ahead.policy(), cost=cost, backend="torch")
        assert p.planned <= 1 or not named  # a named candidate is built at most once
        assert p.chose == 0 or not named  # and no search runs on the critical path
        expect = choose_next(counts, ahead.start(prev), cost=cost).policy
        found = ahead.update(counts, p, previous=prev, cost=cost)
        assert (found is None) == (not named)  # none after the inline step
        assert expect == ahead.policy() and (found is None or found.policy == expect)
        prev = p
    ahead.reset()
    assert ahead.policy() == "auto" and ahead.before is None


def test_the_background_search_keeps_as_inline_auto_does():
    """A plan built by name carries no basis; the search still gets the basis of the
    search that named it, so it keeps its choice where inline ``auto`` would."""
    cost, ahead = _cost(), AheadChoice()
    trace = _trace(1, seed=2) * 6  # the same counts every step: nothing moves
    prev, inline_prev, kept = None, None, 0
    for counts in trace:
        p = plan(counts, previous=prev, policy=ahead.policy(), cost=cost, backend="torch")
        inline = plan(counts, previous=inline_prev, policy="auto", cost=cost, backend="torch")
        if ahead.policy() == "auto":  # the inline search names the next one
            assert ahead.update(counts, p, previous=prev, cost=cost) is None
        else:
            before = ahead.before
            assert before is not None and before.basis is not None
            found = ahead.update(counts, p, previous=prev, cost=cost)
            assert found is not None and found.policy == inline.policy
            kept += found.chose == WORK["keep"]
            assert (found.chose == WORK["keep"]) == (inline.chose == WORK["keep"])
        prev, inline_prev = p, inline
    assert kept >= 3


def test_the_search_starts_from_the_previous_plan_the_step_was_built_from():
    """With no search recorded yet (a fresh or reset state) the search starts from the
    step's own ``previous``, not from nothing: the choice inline auto would have made."""
    cost = _cost()
    c0, c1, c2 = _trace(3, seed=3)
    last = plan(c0, policy="exact", backend="torch")  # e.g. an exact warm-up step
    p = plan(c1, previous=last, policy="auto", cost=cost, backend="torch")
    ahead = AheadChoice()
    assert ahead.start(last) is last and ahead.start(None) is None
    assert ahead.update(c1, p, previous=last, cost=cost) is None  # inline: its own search
    assert p.policy == choose_next(c1, last, cost=cost).policy == ahead.policy()
    ahead = AheadChoice()  # a step built by name (a choice in force), from that plan
    ahead.record(last)
    ahead.take(inline_choice(p))
    found = ahead.update(c1, p, previous=last, cost=cost)
    assert found is not None and found.policy == choose_next(c1, last, cost=cost).policy
    other = plan(c2, policy="exact", backend="torch")  # not the recorded plan: itself
    assert ahead.start(other) is other and ahead.start(p).alloc is p.alloc


def test_choose_next_is_the_lean_search_and_checks_its_inputs() -> None:
    import pytest

    from moonplan.errors import PlanError
    from moonplan.plan.ahead import Before
    from moonplan.plan.choose import Inputs
    from moonplan.plan.search import Choice, search

    cost = _cost()
    c0, c1 = _trace(2, seed=4)
    p0 = plan(c0, slots=2, policy="auto", cost=cost, backend="torch")
    found = choose_next(c1, p0, cost=cost, slots=2)
    inp = Inputs(c1, 2, 1, p0.slot_expert, p0.flow, "torch", p0.policy, p0.basis)
    assert isinstance(found, Choice) and found == search(inp, cost)
    assert choose_next(c1.tolist(), Before.of(p0), cost=cost, slots=2) == found
    assert choose_next(c1, p0, cost=cost, slots=2, backend="reference") == found
    with pytest.raises(PlanError, match=r"previous plan has \(R, E, B\) = \(8, 32, 2\), th"):
        choose_next(c1, p0, cost=cost, slots=3)  # the check moonplan.plan makes
    with pytest.raises(PlanError, match="exact balance only"):
        choose_next(c1, p0, cost=cost, slots=2, backend="cuda")
    with pytest.raises(PlanError):
        choose_next(-c1, p0, cost=cost, slots=2)


# ---- the lag --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("work", "step_s", "search_s", "max_lag", "want"),
    [
        (None, 1e-3, 1e-3, 8, 1),  # no search finished yet
        (4.0, None, 1e-3, 8, 1),  # no step time known yet
        (4.0, 0.0, 1e-3, 8, 1),
        (4.0, 1e-3, 0.0, 8, 1),  # a free search: always the next step
        (0.2, 1e-3, 1e-3, 8, 1),  # a keep test fits in a step
        (4.0, 1e-3, 2.5e-4, 8, 1),  # exactly one step long
        (4.0, 1e-3, 2.6e-4, 8, 2),  # a little more: two
        (4.85, 3e-4, 6e-4, 16, 10),  # the decode case: ceil(2.91 ms / 0.3 ms)
        (4.85, 3e-4, 6e-4, 8, 8),  # capped
        (4.85, 3e-4, 6e-4, 1, 1),
    ],
)
def test_search_lag_is_the_forecast_over_the_step(work, step_s, search_s, max_lag, want) -> None:
    assert search_lag(work, step_s, search_s, max_lag) == want
    if work is not None and step_s and search_s:
        assert want == min(max_lag, max(1, math.ceil(work * search_s / step_s)))


def test_search_lag_checks_its_options() -> None:
    with pytest.raises(ValueError, match="max_lag"):
        search_lag(1.0, 1.0, 1e-3, 0)
    with pytest.raises(ValueError, match="search_s"):
        AheadChoice(search_s=-1.0)
    assert AheadChoice().max_lag == MAX_LAG >= 1


def _run(trace: list[torch.Tensor], ahead: AheadChoice, cost: StepCost) -> list[tuple]:
    """``(policy, alloc, lag or 0, took)`` per step of the in-caller schedule: ``lag`` of
    the search started after the step, ``took``: a search was put in force after it (the
    next step is the one it names)."""
    prev, out = None, []
    for counts in trace:
        p = plan(counts, previous=prev, policy=ahead.policy(), cost=cost, backend="torch")
        was = ahead.searching
        found = ahead.update(counts, p, previous=prev, cost=cost)
        took = (was or found is not None) and not ahead.searching
        out.append((p.policy, p.alloc, ahead.last_lag if found else 0, took))
        prev = p
    return out


def test_lag_one_is_todays_schedule_plan_for_plan() -> None:
    """``search_s = 0`` (and any search that fits in a step) gives ``L = 1`` at every
    step: plan for plan the one-step-ahead schedule (a search after every step but the
    inline first, each taken by the next step)."""
    cost, trace = _cost(), _trace(10, seed=5)
    today = _run(trace, AheadChoice(), cost)
    fits = _run(trace, AheadChoice(search_s=1e-9), cost)  # a search far shorter than a step
    for (pa, aa, la, _), (pb, ab, lb, _) in zip(today, fits, strict=True):
        assert pa == pb and torch.equal(aa, ab) and la == lb
    assert [lag for *_, lag, _ in today] == [0] + [1] * 9
    # the reference: step t + 1 builds what the search on step t's counts named
    prev, ref = None, AheadChoice()
    for t, counts in enumerate(trace[:-1]):
        p = plan(counts, previous=prev, policy=ref.policy(), cost=cost, backend="torch")
        start = ref.start(prev)
        ref.update(counts, p, previous=prev, cost=cost)
        if t:
            assert today[t + 1][0] == choose_next(counts, start, cost=cost).policy
        prev = p


def test_a_long_search_names_the_step_lag_steps_later() -> None:
    """A search forecast ``L`` steps long: steps ``t+1 .. t+L-1`` keep the candidate in
    force, step ``t+L`` takes the search (``due``) and the next search starts after it."""
    cost, trace = _cost(), _trace(14, seed=6)
    ahead = AheadChoice(search_s=cost.plan_s * 40, max_lag=4)
    steps = _run(trace, ahead, cost)
    starts = [t for t, (_, _, lag, _) in enumerate(steps) if lag]
    lags = [steps[t][2] for t in starts]
    assert starts[0] == 1 and max(lags) > 1 and max(lags) <= 4
    for t, lag in zip(starts, lags, strict=False):
        nxt = t + lag
        if nxt < len(steps):  # one in flight: the next starts at the step it names
            assert steps[nxt - 1][3] and nxt in starts
            assert not any(steps[u][3] for u in range(t, nxt - 1))
            assert not any(steps[u][2] for u in range(t + 1, nxt))
            kept = {steps[u][0] for u in range(t + 1, nxt)}
            assert len(kept) <= 1  # the candidate in force, built by name


def test_the_lag_comes_from_the_last_full_choices() -> None:
    """``L`` of the next search: the largest work of the last ``FORECAST_CHOICES`` full
    choices taken at ``search_s`` over the last one's predicted step; a kept choice
    (nothing predicted) changes neither."""
    cost, trace = _cost(), _trace(16, seed=7)
    search_s = cost.plan_s * 3
    ahead, prev, pending = AheadChoice(search_s=search_s, max_lag=64), None, None
    works: list[float] = []  # the work of every full choice taken, in order
    step_s = None
    lags = []
    for counts in trace:
        p = plan(counts, previous=prev, policy=ahead.policy(), cost=cost, backend="torch")
        inline = ahead.policy() == "auto"
        found = ahead.update(counts, p, previous=prev, cost=cost)
        if found is not None:
            assert works  # the inline first step is the first taken
            want = max(works[-FORECAST_CHOICES:])
            assert ahead.last_lag == search_lag(want, step_s, search_s, 64)
            lags.append(ahead.last_lag)
            pending = found
        taken = inline_choice(p) if inline else None
        if pending is not None and not ahead.searching:
            taken, pending = pending, None
        if taken is not None and (not works or taken.policy in taken.predicted):
            works.append(taken.planned + taken.chose)
            step_s = taken.predicted.get(taken.policy)
        prev = p
    assert len(lags) >= 2 and max(lags) > 1


def test_a_light_full_choice_does_not_shorten_the_lag() -> None:
    """After a heavy full choice (12 construction equivalents), a light one (3) leaves
    the forecast at the heavy one's work until it leaves the window of
    ``FORECAST_CHOICES`` full choices; kept choices (nothing predicted) do not count."""
    from moonplan.plan.search import Choice

    ahead = AheadChoice(search_s=1e-3, max_lag=64)

    def full(work: float) -> Choice:
        return Choice("exact", {"exact": 1e-3, "static": 2e-3}, int(work), 0.0, None)

    kept = Choice("exact", {}, 0, WORK["keep"], None)
    ahead.take(full(12))
    assert ahead.lag() == 12  # 12 ms of search over a 1 ms step
    for _ in range(FORECAST_CHOICES - 1):
        ahead.take(full(3))
        ahead.take(kept)
        assert ahead.lag() == 12
    ahead.take(full(3))  # the heavy one leaves the window
    assert ahead.lag() == 3
    ahead.reset()
    assert ahead.lag() == 1


def test_every_rank_names_the_same_candidates_with_a_lag() -> None:
    """Two states fed the same all-gathered counts (two ranks) agree step by step, on the
    names, the lags and the steps that take a search."""
    cost, trace = _cost(), _trace(12, seed=8)
    a = _run(trace, AheadChoice(search_s=cost.plan_s * 40, max_lag=4), cost)
    b = _run(trace, AheadChoice(search_s=cost.plan_s * 40, max_lag=4), cost)
    assert [(x[0], x[2], x[3]) for x in a] == [(y[0], y[2], y[3]) for y in b]
    assert all(torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True))


def test_search_budget_is_the_work_that_fits_beside_the_lag() -> None:
    from moonplan.plan.ahead import search_budget

    assert search_budget(3, 2e-3, 5e-4) == pytest.approx(12.0)
    assert search_budget(1, None, 5e-4) is None
    assert search_budget(2, 1e-3, 0.0) is None


def test_each_search_runs_within_the_budget_of_its_lag() -> None:
    """``launch`` sets ``last_budget`` from the lag it picks, less the measure's updates of
    the steps since the last search (they run first in the same thread); ``update`` runs
    the search with it (the choice ``choose_next`` makes with that budget), and no search
    spends more than it beyond the setup and the fetch-free scores."""
    from moonplan.plan.ahead import executed, search_budget
    from moonplan.plan.reuse import OBSERVE_WORK, ReplicaLife

    cost, trace = _cost(), _trace(14, seed=9)
    ahead = AheadChoice(search_s=cost.plan_s * 40, max_lag=2)  # lags capped: budgets bind
    prev, life, budgets, pending = None, ReplicaLife(), [], 0
    import dataclasses

    for counts in trace:
        pending += 1  # this step's update, queued before the next search
        p = plan(counts, previous=prev, policy=ahead.policy(), cost=cost, backend="torch")
        start = ahead.start(prev)
        life.observe(*executed(p))
        step_s = ahead._step_s
        found = ahead.update(counts, p, previous=prev, cost=cost)
        if found is not None:
            full = search_budget(ahead.last_lag, step_s, ahead.search_s)
            assert full is not None
            want = max(0.0, full - pending * OBSERVE_WORK)
            assert ahead.last_budget == pytest.approx(want)
            want, pending = ahead.last_budget, 0
            horizon = dataclasses.replace(cost, horizon=life.horizon(cost.horizon))
            assert found == choose_next(counts, start, cost=horizon, budget=want)
            floor = WORK["setup"] + WORK["score"] * len(found.predicted)
            assert found.planned + found.chose <= max(want, floor) + 1e-9
            budgets.append(want)
        prev = p
    assert len(budgets) >= 3
