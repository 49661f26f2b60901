"""The planner: counts ``[R, E]`` in, an exactly balanced :class:`Plan` out."""

from moonplan.plan.api import plan
from moonplan.plan.home import home_map
from moonplan.plan.plan_type import Plan
from moonplan.plan.route import Route, route

__all__ = ["Plan", "Route", "home_map", "plan", "route"]
