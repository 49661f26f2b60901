"""The load window: a ring of the last ``W`` steps' per-expert loads."""

from __future__ import annotations

import pytest
import torch

from moonplan.plan.residency.window import LoadWindow


def test_the_window_keeps_the_last_w_steps() -> None:
    w = LoadWindow(3, window=2)
    assert w.filled == 0 and w.totals_E().tolist() == [0, 0, 0]
    for step in ([[1, 0, 0], [1, 0, 0]], [[0, 5, 0], [0, 0, 0]], [[0, 0, 7], [0, 0, 1]]):
        w.observe(torch.tensor(step))
    assert w.filled == 2 and w.steps == 3
    assert w.totals_E().tolist() == [0, 5, 8]  # the first step left the ring


def test_prime_adds_the_steps_before_and_keeps_only_the_last_w() -> None:
    w = LoadWindow(2, window=2)
    assert w.loads().shape == (0, 2)  # nothing observed yet
    w.prime(torch.tensor([[9, 9], [1, 0], [0, 2]]))
    assert w.totals_E().tolist() == [1, 2] and w.filled == 2
    assert sorted(w.loads().tolist()) == [[0, 2], [1, 0]]  # each step held, ring order


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_window_is_a_whole_number_of_steps(bad: object) -> None:
    with pytest.raises(ValueError, match="window"):
        LoadWindow(3, window=bad)  # type: ignore[arg-type]
