"""Baselines: the MoonEP greedy, static EP; moonplan never needs more copies than the greedy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

import moonplan
from moonplan.baselines.moonep_greedy import (
    copies_lower_bound,
    moonep_greedy_alloc,
    replica_count,
    replica_pairs,
)
from moonplan.baselines.static_ep import max_over_mean, static_alloc
from moonplan.testing import counts
from moonplan.traces import COUNT_FAMILIES, generate_counts


def test_greedy_on_the_worked_example() -> None:
    c = torch.zeros(4, 8, dtype=torch.int64)
    c[0] = torch.tensor([9, 1, 2, 0, 3, 5, 4, 8])
    a = moonep_greedy_alloc(c)
    assert a.sum(0).tolist() == [8, 8, 8, 8]
    assert a.sum(1).tolist() == c.sum(0).tolist()
    assert replica_count(a) == 2
    assert copies_lower_bound(c) == 1  # only rank 1 is below its target


@given(counts())
def test_greedy_is_an_exact_plan_and_moonplan_never_copies_more(c: torch.Tensor) -> None:
    a = moonep_greedy_alloc(c)
    assert torch.equal(a.sum(1), c.sum(0))
    p = moonplan.plan(c)
    assert torch.equal(a.sum(0), p.target)
    assert copies_lower_bound(c) <= p.copies() <= replica_count(a)


def test_moonplan_never_copies_more_across_families_at_scale() -> None:
    for family in COUNT_FAMILIES:
        for R, E, K in [(8, 64, 8), (16, 256, 8), (32, 96, 4)]:
            c = generate_counts(family, ranks=R, experts=E, tokens=256, topk=K, seed=R + E)
            p = moonplan.plan(c)
            assert p.copies() <= replica_count(moonep_greedy_alloc(c)), (family, R, E)
            assert p.copies() >= copies_lower_bound(c)


def test_static_ep() -> None:
    c = torch.tensor([[4, 0, 0, 0], [4, 0, 0, 0]])
    a = static_alloc(c)
    assert a.tolist() == [[8, 0], [0, 0], [0, 0], [0, 0]]
    assert max_over_mean(a) == 2.0
    assert max_over_mean(static_alloc(torch.zeros(2, 4, dtype=torch.int64))) == 1.0


@given(counts(max_ranks=8, max_experts=24))
def test_greedy_step_is_its_allocation_with_one_home_map(c: torch.Tensor) -> None:
    """The greedy's step (a peer's model: results unchanged) is its allocation's replica
    moves, pairs and home map, built from one home map and one set of pairs."""
    from unittest import mock

    from moonplan.baselines import moonep_greedy
    from moonplan.baselines.moonep_greedy import GreedyPolicy, replica_moves

    R, E = c.shape
    a = moonep_greedy_alloc(c)
    with mock.patch.object(moonep_greedy, "home_map", wraps=moonep_greedy.home_map) as homes:
        step = GreedyPolicy(R, E).step(c)
    assert homes.call_count == 1
    assert torch.equal(step.alloc_ER, a)
    assert torch.equal(step.moves_C2, replica_moves(a))
    assert torch.equal(step.fetch_ER, replica_pairs(a))
    assert torch.equal(step.src_E, moonplan.home_map(E, R))
    assert step.copies == replica_count(a)


def test_compare_primes_the_policies_that_read_the_past() -> None:
    """``before`` gives the deployed EPLB its window before each layer's trace: it then
    serves a placement planned from loads, where without it the uniform one serves."""
    from moonplan.baselines.compare import compare_policies
    from moonplan.baselines.prehistory import Prehistory

    hot = torch.tensor([[9, 1, 9, 1], [0, 0, 0, 0]])
    counts = hot.expand(1, 3, 2, 4).clone()

    def before(layer: int, steps_N: torch.Tensor) -> Prehistory:
        return Prehistory(steps_N, torch.tensor([9, 1, 9, 1]).expand(len(steps_N), 4).clone())

    opts = {"redundant": 0, "eplb_window": 2, "eplb_period": 4, "eplb_first": 2}
    primed = compare_policies(counts, ["eplb"], before=before, **opts)[0]
    cold = compare_policies(counts, ["eplb"], **opts)[0]
    # planned from the loads: {0, 1} and {2, 3}, 10 and 10; uniform: {0, 2} and {1, 3}
    assert primed["max_over_mean"] == 1.0 and cold["max_over_mean"] == pytest.approx(1.8)
