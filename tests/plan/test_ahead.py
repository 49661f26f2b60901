"""moonplan.plan.ahead: the lagged choice is inline auto's choice one step back."""

import torch

from moonplan.cost import get_preset
from moonplan.plan import plan
from moonplan.plan.ahead import AheadChoice, choose_next
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
    ahead.update(c0, p0, previous=None, cost=cost)
    assert ahead.policy() == plan(c0, policy="auto", cost=cost, backend="torch").policy
    assert ahead.before is p0


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
        assert found.policy == expect == ahead.policy()
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
        if ahead.policy() == "auto":
            ahead.settle(p.policy, p, basis=p.basis)  # the inline search named the next one
        else:
            before = ahead.before
            assert before is not None and before.basis is not None
            found = ahead.update(counts, p, previous=prev, cost=cost)
            assert found.policy == inline.policy
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
    found = ahead.update(c1, p, previous=last, cost=cost)
    assert found.policy == choose_next(c1, last, cost=cost).policy == ahead.policy()
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
    with pytest.raises(PlanError, match=r"\(R, B, E\)"):
        choose_next(c1, p0, cost=cost, slots=3)
    with pytest.raises(PlanError, match="exact balance only"):
        choose_next(c1, p0, cost=cost, slots=2, backend="cuda")
    with pytest.raises(PlanError):
        choose_next(-c1, p0, cost=cost, slots=2)
