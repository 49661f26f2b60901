"""The planner: counts ``[R, E]`` in, an exactly balanced :class:`Plan` out."""

from moonplan.plan.api import plan
from moonplan.plan.home import home_map
from moonplan.plan.plan_type import Plan

__all__ = ["Plan", "home_map", "plan"]
