"""moonplan: exactly balanced Mixture-of-Experts expert parallelism.

Public names only; see ``docs/`` for the design and ``README.md`` for a quick start.

Submodules load on first attribute access (PEP 562, :data:`SUBMODULES` maps each name to
its module: ``moonplan.profile`` is ``moonplan.profiling.session``, ``moonplan.checkpoint``
is ``moonplan.adapters.checkpoint``), so ``import moonplan`` stays light and
``moonplan.checkpoint``, ``moonplan.cost``, ``moonplan.traces``, ... work after it.
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
SUBMODULES = {
    "adapters": "moonplan.adapters",
    "baselines": "moonplan.baselines",
    "checkpoint": "moonplan.adapters.checkpoint",
    "cli": "moonplan.cli",
    "comm": "moonplan.comm",
    "cost": "moonplan.cost",
    "demo": "moonplan.cli.demo",
    "errors": "moonplan.errors",
    "layer": "moonplan.layer",
    "profile": "moonplan.profiling.session",
    "profiling": "moonplan.profiling",
    "runtime": "moonplan.runtime",
    "simulate": "moonplan.simulate",
    "stepcost": "moonplan.stepcost",
    "tables": "moonplan.tables",
    "testing": "moonplan.testing",
    "trace_recorder": "moonplan.traces.recorder",
    "traces": "moonplan.traces",
}
"""Public attribute name -> the module it loads (PEP 562, on first access)."""


def __getattr__(name: str) -> Any:
    if name in SUBMODULES:
        return importlib.import_module(SUBMODULES[name])
    raise AttributeError(f"module 'moonplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(SUBMODULES))
