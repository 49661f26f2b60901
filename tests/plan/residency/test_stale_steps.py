"""stale_steps: the ways of steps with no slot kept, step by step, scored once per decision."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonplan.plan.residency.exact_way import exact_steps_s
from moonplan.plan.residency.home_choice import map_way, stale_offer
from moonplan.plan.residency.serving import empty_slots
from moonplan.plan.residency.stale_steps import STALE_WAYS, stale_steps
from moonplan.plan.residency.target import table_ways, window_rows
from moonplan.plan.residency.window_torch import static_torch, static_training_torch
from moonplan.plan.residency.work import Builds
from tests.baselines.test_auto_ordered import COST, _trace


def _rows(loads_SE: torch.Tensor, R: int = 4) -> torch.Tensor:
    return window_rows(loads_SE.sum(0), loads_SE.shape[0], R, loads_SE)


def _window(S: int, seed: int) -> torch.Tensor:
    return torch.stack([c.sum(0) for c in _trace(S, seed=seed)])  # [S, 16], 4 ranks


@settings(max_examples=12, deadline=None)
@given(S=st.integers(1, 6), seed=st.integers(0, 50), slots=st.integers(0, 3))
def test_the_best_way_is_the_least_of_every_way_summed(S: int, seed: int, slots: int) -> None:
    """:meth:`StaleSteps.best` is the reference rule: the empty table's best way, or the
    exact kernel from empty slots where it is faster, summed as each scores its steps."""
    rows_SRE = _rows(_window(S, seed))
    best = table_ways(COST, rows_SRE, empty_slots(4, slots)[None])[0]
    exact = sum(exact_steps_s(COST, rows_SRE, empty_slots(4, slots), chain=False))
    want = (exact, "exact") if exact < best[0] else best
    assert stale_steps(COST, rows_SRE, slots).best() == want
    steps = stale_steps(COST, rows_SRE, slots)
    assert len(steps.seconds_WS) == len(STALE_WAYS) and {len(s) for s in steps.seconds_WS} == {S}


@settings(max_examples=12, deadline=None)
@given(S=st.integers(2, 8), seed=st.integers(0, 50), slots=st.integers(1, 3))
def test_a_later_part_of_the_window_reads_as_if_scored_alone(S: int, seed: int, slots: int) -> None:
    """The newer steps' best, read from the whole window's scores, equals scoring them
    alone, float for float: a decision in training scores each step once."""
    loads_SE = _window(S, seed)
    whole = stale_steps(COST, _rows(loads_SE), slots)
    for first in range(S):
        alone = stale_steps(COST, _rows(loads_SE[first:]), slots).best()
        assert whole.best(first) == alone


@settings(max_examples=8, deadline=None)
@given(S=st.integers(2, 8), seed=st.integers(0, 50))
def test_a_stale_offer_reads_the_labels_seconds_instead_of_scoring_them(S: int, seed: int) -> None:
    loads_SE = _window(S, seed)
    scored, read = Builds(), Builds()
    alone = stale_offer(COST, loads_SE, 4, 2, scored)
    whole = stale_steps(COST, _rows(loads_SE), 2, training=True)
    reused = stale_offer(COST, loads_SE, 4, 2, read, whole)
    assert reused == alone
    if alone is not None:  # the labels' newer half was not built again
        assert scored.made - read.made == S - S // 2 and read.scored < scored.scored
        newer_s = map_way(COST, loads_SE[S // 2 :], 4, 2, training=True)[0]
        assert newer_s == whole.best(S // 2)[0]


def test_an_offer_made_from_the_windows_scores_builds_only_the_order() -> None:
    loads_SE = _window(4, 7)  # hot experts 0-3 on rank 0: an order is offered
    scored, read = Builds(), Builds()
    alone = stale_offer(COST, loads_SE, 4, 2, scored)
    whole = stale_steps(COST, _rows(loads_SE), 2, training=True)
    reused = stale_offer(COST, loads_SE, 4, 2, read, whole)
    assert alone is not None and reused == alone
    assert (scored.made, read.made) == (4, 2)  # the newer half under both maps; the order's alone
    forward = stale_steps(COST, _rows(loads_SE), 2)  # scored without the backward: refused
    with pytest.raises(ValueError, match="training steps"):
        stale_offer(COST, loads_SE, 4, 2, None, forward)


@settings(max_examples=10, deadline=None)
@given(S=st.integers(1, 5), seed=st.integers(0, 50), slots=st.integers(0, 2))
def test_a_training_step_adds_each_ways_backward(S: int, seed: int, slots: int) -> None:
    """Scored as training steps, an empty table's ways add static EP's backward (they
    serve its plan), and the exact way its own plan's: every way is slower than its
    forward alone, by at least the forward's dispatch, experts and combine."""
    rows_SRE = _rows(_window(S, seed))
    forward = stale_steps(COST, rows_SRE, slots)
    training = stale_steps(COST, rows_SRE, slots, training=True)
    forward_S, back = static_training_torch(COST, rows_SRE)
    back_S = back.tolist()
    for w, way in enumerate(STALE_WAYS):
        for s in range(S):
            f, t = forward.seconds_WS[w][s], training.seconds_WS[w][s]
            if way != "exact":
                assert t == f + back_S[s]
            assert t > f
    static_S = static_torch(COST, rows_SRE).tolist()  # d + e + c; its backward d + 2e + c
    assert forward_S.tolist() == static_S  # one scoring gives both, float for float
    assert all(b >= x - 1e-15 for b, x in zip(back_S, static_S, strict=True))
