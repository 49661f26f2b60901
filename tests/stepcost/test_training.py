"""stepcost.training: a training step is its forward and the backward that replays it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moonplan.stepcost import StepTime
from moonplan.stepcost.batch import BatchTime
from moonplan.stepcost.training import BACKWARD_GEMMS, backward_s, training_time

FORWARD = StepTime(plan_s=5.0, prefetch_s=7.0, prefetch_exposed_s=3.0, dispatch_s=10.0,
                   experts_s=20.0, combine_s=11.0, total_s=49.0)  # fmt: skip


def test_the_backward_replays_the_forwards_rows_twice_its_gemms_and_its_exposed_copies() -> None:
    assert BACKWARD_GEMMS == 2
    assert backward_s(FORWARD) == 10.0 + 2 * 20.0 + 11.0 + 3.0  # no planning
    t = training_time(FORWARD)
    assert t.total_s == 49.0 + 64.0 and t.plan_s == 5.0  # planned once
    assert (t.dispatch_s, t.experts_s, t.combine_s) == (20.0, 60.0, 22.0)
    assert (t.prefetch_s, t.prefetch_exposed_s) == (14.0, 6.0)


def test_a_step_with_nothing_to_wait_for_costs_its_phases_and_then_its_backward() -> None:
    plain = dataclasses.replace(FORWARD, plan_s=0.0, prefetch_s=0.0, prefetch_exposed_s=0.0,
                                total_s=41.0)  # fmt: skip
    assert training_time(plain).total_s == pytest.approx(41.0 + 10.0 + 40.0 + 11.0)


def test_the_same_rule_on_batched_phases() -> None:
    """``BatchTime`` (tensors, one per candidate) takes the same backward, float for float."""
    one = lambda x: torch.tensor([x, 2 * x], dtype=torch.float64)  # noqa: E731
    batch = BatchTime(*(one(v) for v in dataclasses.astuple(FORWARD)))
    got = backward_s(batch)
    assert got.tolist() == [backward_s(FORWARD), backward_s(StepTime(*(2 * v for v in
                            dataclasses.astuple(FORWARD))))]  # fmt: skip
