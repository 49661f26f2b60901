"""Tests for ``moonplan.testing`` strategies: every edge case occurs, and plans hold on them.

Legend: R ranks, E experts, N total records, M = ceil(E/R).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

import moonplan
from moonplan.testing import COUNTS_FAMILIES, counts, counts_and_options, plan_options
from moonplan.testing.strategies import ALIGNS

SEARCH = settings(
    max_examples=1000,
    database=None,
    derandomize=True,
    deadline=None,
    phases=[Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)


def occurs(
    strategy: st.SearchStrategy[torch.Tensor], condition: Callable[[torch.Tensor], bool]
) -> torch.Tensor:
    """A (shrunk) example of ``strategy`` meeting ``condition``; fails the test if none is found."""
    return find(strategy, condition, settings=SEARCH)


def total(c: torch.Tensor) -> int:
    return int(c.sum())


# ---- every edge case occurs ---------------------------------------------------------------------


def test_fewer_experts_than_ranks() -> None:
    c = occurs(counts(), lambda c: c.shape[1] < c.shape[0] and total(c) > 0)
    assert c.shape[1] < c.shape[0]


def test_experts_not_a_multiple_of_ranks() -> None:
    occurs(counts(), lambda c: c.shape[1] > c.shape[0] > 1 and c.shape[1] % c.shape[0] != 0)


def test_records_not_a_multiple_of_ranks() -> None:
    occurs(counts(), lambda c: total(c) % c.shape[0] != 0)


def test_all_zero_counts() -> None:
    occurs(counts(), lambda c: total(c) == 0 and c.shape[0] > 1 and c.shape[1] > 1)


def test_ranks_without_tokens() -> None:
    occurs(counts(), lambda c: total(c) > 0 and bool((c.sum(1) == 0).any()))


def test_hot_expert_exceeds_a_rank_target() -> None:
    def hot(c: torch.Tensor) -> bool:
        R = c.shape[0]
        return R > 1 and int(c.sum(0).max()) > -(-total(c) // R)

    occurs(counts(families=["hot"]), hot)


@pytest.mark.parametrize("family", ["lognormal", "zipf", "hot"])
def test_skewed_families_are_skewed(family: str) -> None:
    def skewed(c: torch.Tensor) -> bool:
        load_E = c.sum(0).double()
        return c.shape[1] >= 8 and total(c) >= 100 and float(load_E.max() / load_E.mean()) > 3

    occurs(counts(families=[family], sigma=2.0 if family == "lognormal" else None), skewed)


@given(counts(families=["uniform"], empty_ranks=False))
def test_uniform_rows_are_even(c: torch.Tensor) -> None:
    assert bool((c.max(1).values - c.min(1).values <= 1).all())


@given(counts(families=["lognormal"], sigma=0.0))
def test_lognormal_with_sigma_zero_is_uniform(c: torch.Tensor) -> None:
    assert bool((c.max(1).values - c.min(1).values <= 1).all())


def test_each_family_alone_is_drawable() -> None:
    for family in COUNTS_FAMILIES:
        occurs(counts(families=[family]), lambda c: True)


# ---- shapes, bounds and arguments ---------------------------------------------------------------


@given(counts(min_ranks=2, max_ranks=5, min_experts=3, max_experts=9, max_records_per_rank=20))
def test_counts_respect_bounds(c: torch.Tensor) -> None:
    R, E = c.shape
    assert c.dtype == torch.int64 and c.device.type == "cpu"
    assert 2 <= R <= 5 and 3 <= E <= 9
    assert bool((c >= 0).all())
    assert bool((c.sum(1) <= 2 * 20 + E).all())  # "random" rows may reach about twice the bound


@given(counts(families=["zero"]))
def test_zero_family_is_zero(c: torch.Tensor) -> None:
    assert total(c) == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_ranks": 0},
        {"min_ranks": 5, "max_ranks": 4},
        {"max_experts": 0},
        {"max_records_per_rank": -1},
        {"families": []},
        {"families": ["bimodal"]},
        {"sigma": -1.0},
    ],
)
def test_counts_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        counts(**kwargs)


@given(st.data())
def test_plan_options_are_in_range(data: st.DataObject) -> None:
    R, E = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 24))
    opts = data.draw(plan_options(R, E))
    M = -(-E // R)
    assert set(opts) == {"slots", "align"}
    assert opts["slots"] is None or 0 <= opts["slots"] <= M + 2
    assert opts["align"] in ALIGNS


@pytest.mark.parametrize(
    "condition",
    [
        lambda o: o["slots"] is None,
        lambda o: o["slots"] == 0,
        lambda o: o["slots"] == 3 + 2,  # M + 2 for E = 7, R = 3
        lambda o: o["align"] == 128,
    ],
)
def test_plan_options_cover_defaults_direct_and_extra_slots(condition: Callable) -> None:
    find(plan_options(3, 7), condition, settings=SEARCH)


@pytest.mark.slow  # a fresh interpreter imports torch (2.3-6.5 s)
def test_strategies_load_lazily_without_hypothesis() -> None:
    code = "import sys, moonplan, moonplan.testing; assert 'hypothesis' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- the planner holds on every drawn input -----------------------------------------------------


@given(counts_and_options())
def test_plan_meets_invariants_on_drawn_counts(case: tuple[torch.Tensor, dict]) -> None:
    counts_RE, opts = case
    moonplan.check_plan(moonplan.plan(counts_RE, **opts), counts_RE)


@given(st.data())
def test_plan_with_previous_meets_invariants(data: st.DataObject) -> None:
    first = data.draw(counts())
    R, E = first.shape
    second = data.draw(counts(min_ranks=R, max_ranks=R, min_experts=E, max_experts=E))
    opts = data.draw(plan_options(R, E))
    previous = moonplan.plan(first, **opts)
    p = moonplan.plan(second, previous=previous, **opts)
    moonplan.check_plan(p, second, previous=previous)


@given(st.data())
def test_allocs_conserve_records_and_fit_the_row_layout(data: st.DataObject) -> None:
    from moonplan.testing import allocs

    c = data.draw(counts(max_ranks=6, max_experts=12))
    R, E = c.shape
    slots = data.draw(st.none() | st.integers(0, E))
    a = data.draw(allocs(c, slots=slots))
    assert a.shape == (E, R) and a.dtype == torch.int64 and bool((a >= 0).all())
    assert torch.equal(a.sum(1), c.sum(0))
    home = moonplan.home_map(E, R)
    remote_R = ((a > 0) & (home[:, None] != torch.arange(R)[None, :])).sum(0)
    M = -(-E // R)
    assert int(remote_R.max()) <= max(M, M if slots is None else slots)
