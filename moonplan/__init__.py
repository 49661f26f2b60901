"""moonplan: exactly balanced Mixture-of-Experts expert parallelism.

Public names only; see ``docs/`` for the design and ``README.md`` for a quick start.
"""

from moonplan.errors import PlanError
from moonplan.layer import MoonMoE
from moonplan.plan import Plan, Route, home_map, plan, route
from moonplan.testing.invariants import check_plan

__all__ = ["MoonMoE", "Plan", "PlanError", "Route", "check_plan", "home_map", "plan", "route"]
__version__ = "0.1.0"
