"""moonplan: exactly balanced Mixture-of-Experts expert parallelism.

Public names only; see ``docs/`` for the design and ``README.md`` for a quick start.
"""

from moonplan.errors import PlanError
from moonplan.plan import Plan, home_map, plan
from moonplan.testing.invariants import check_plan

__all__ = ["Plan", "PlanError", "check_plan", "home_map", "plan"]
__version__ = "0.1.0"
