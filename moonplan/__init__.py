"""moonplan: exactly balanced Mixture-of-Experts expert parallelism.

Public names only; see ``docs/`` for the design and ``README.md`` for a quick start.

Submodules load on first attribute access (PEP 562), so ``import moonplan`` stays light
and ``moonplan.checkpoint``, ``moonplan.cost``, ``moonplan.traces``, ... work after it.
"""

import importlib
from typing import Any

from moonplan.adapters import wrap, wrap_experts, wrap_model
from moonplan.errors import PlanError
from moonplan.layer import MoonMoE
from moonplan.plan import Plan, Route, home_map, plan, route
from moonplan.runtime.config import MoEConfig
from moonplan.testing.invariants import check_plan

__all__ = [
    "MoEConfig",
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

# Loaded on first access; ``moonplan.plan`` is the function (``moonplan.plan`` the package
# is ``import moonplan.plan as ...`` or ``from moonplan.plan import ...``).
SUBMODULES = (
    "adapters",
    "baselines",
    "checkpoint",
    "comm",
    "cost",
    "demo",
    "errors",
    "layer",
    "profile",
    "profiling",
    "runtime",
    "simulate",
    "stepcost",
    "testing",
    "trace_recorder",
    "traces",
)


def __getattr__(name: str) -> Any:
    if name in SUBMODULES:
        return importlib.import_module(f"moonplan.{name}")
    raise AttributeError(f"module 'moonplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(SUBMODULES))
