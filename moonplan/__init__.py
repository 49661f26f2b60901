"""moonplan: exactly balanced Mixture-of-Experts expert parallelism.

Public names only; see ``docs/`` for the design and ``README.md`` for a quick start.
"""

from moonplan.adapters import wrap, wrap_experts, wrap_model
from moonplan.errors import PlanError
from moonplan.layer import MoonMoE
from moonplan.plan import Plan, Route, home_map, plan, route
from moonplan.testing.invariants import check_plan

__all__ = [
    "MoonMoE",
    "Plan",
    "PlanError",
    "Route",
    "check_plan",
    "home_map",
    "plan",
    "route",
    "wrap",
    "wrap_experts",
    "wrap_model",
]
__version__ = "0.1.0"
