"""The step-time cost model shared by the planner (``policy="auto"``), runtime and simulator.

``StepCost`` predicts one MoE layer step's phases from what a policy does (rows per
rank and expert, rows sent, weights fetched); ``HARDWARE`` holds the hardware presets
it can be built from; ``traffic`` splits dispatch volumes by link. See
``docs/planner-policy.md`` and ``docs/simulator.md``.
"""

from moonplan.stepcost.hardware import HARDWARE, Hardware, get_hardware
from moonplan.stepcost.plan_compat import plan_fetch_ER
from moonplan.stepcost.step_cost import StepCost, StepTime
from moonplan.stepcost.traffic import (
    SCHEMES,
    Traffic,
    dispatch_traffic,
    pair_traffic,
    scheme_traffic,
)

__all__ = [
    "HARDWARE",
    "SCHEMES",
    "Hardware",
    "StepCost",
    "StepTime",
    "Traffic",
    "dispatch_traffic",
    "get_hardware",
    "pair_traffic",
    "plan_fetch_ER",
    "scheme_traffic",
]
