"""Step-time simulator: estimate per-step MoE layer time of every balancing policy from counts.

See ``docs/simulator.md`` for the model, its assumptions and the simulated tables.
"""

from moonplan.simulate.model_time import (
    SimConfig,
    StepTime,
    default_plan_us,
    ideal_time,
    step_time,
)
from moonplan.simulate.models import get_model
from moonplan.simulate.sweep import SweepSpec, break_even, simulate_trace, sweep
from moonplan.stepcost.hardware import HARDWARE, Hardware, get_hardware

__all__ = [
    "HARDWARE",
    "Hardware",
    "SimConfig",
    "StepTime",
    "SweepSpec",
    "break_even",
    "default_plan_us",
    "get_hardware",
    "get_model",
    "ideal_time",
    "simulate_trace",
    "step_time",
    "sweep",
]
