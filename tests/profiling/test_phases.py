"""The phase names: every one is one the runtime times, each in one sequence."""

from __future__ import annotations

from moonplan.profiling.phases import (
    BACKGROUND_PHASES,
    BACKWARD_PHASES,
    FORWARD_PHASES,
    PHASES,
    sequence_of,
)
from moonplan.runtime.step_stats import BACKGROUND


def test_background_phases_are_step_phases_the_runtime_marks_too() -> None:
    assert set(BACKGROUND_PHASES) <= set(PHASES)
    assert BACKGROUND == BACKGROUND_PHASES  # StepStats prints the same ones as background
    assert "choice" not in PHASES and "choice_exposed" not in PHASES  # the host search is gone


def test_each_phase_has_its_sequence() -> None:
    assert {sequence_of(n) for n in FORWARD_PHASES} == {"forward"}
    assert {sequence_of(n) for n in BACKWARD_PHASES} == {"backward"}
    assert sequence_of("my_region") == "my_region"  # a user region is its own sequence
