"""moonplan: exactly balanced Mixture-of-Experts expert parallelism.

Public names only; see ``docs/`` for the design and ``README.md`` for a quick start.

Every public name loads on first access (PEP 562): :data:`NAMES` maps each function or
class to its module, :data:`SUBMODULES` each submodule attribute (``moonplan.checkpoint``
is ``moonplan.adapters.checkpoint``). So ``import moonplan`` imports neither torch nor
any submodule (the ``moonplan`` command answers ``--help`` without them), and
``moonplan.plan(...)``, ``from moonplan import MoonMoE``, ``moonplan.cost``,
``moonplan.traces``, ... work after it.

``moonplan.plan`` is the planning function and ``moonplan.profile`` the profiler's context
manager (``with moonplan.profile(model) as prof:``). The packages behind them are
``moonplan.plan`` for imports (``from moonplan.plan import Route``) and
``moonplan.profiling``.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers and editors see them
    from moonplan.adapters import rehome_model, wrap, wrap_experts, wrap_model
    from moonplan.core.moe import MoonMoE
    from moonplan.errors import PlanError
    from moonplan.plan import Plan, Route, home_map, plan, route
    from moonplan.profiling.session import profile
    from moonplan.runtime.config import MoEConfig
    from moonplan.testing.invariants import check_plan

__version__ = "0.1.0"

NAMES = {
    "MoEConfig": "moonplan.runtime.config",
    "MoonMoE": "moonplan.core.moe",
    "Plan": "moonplan.plan",
    "PlanError": "moonplan.errors",
    "Route": "moonplan.plan",
    "check_plan": "moonplan.testing.invariants",
    "home_map": "moonplan.plan",
    "plan": "moonplan.plan",
    "profile": "moonplan.profiling.session",
    "rehome_model": "moonplan.adapters",
    "route": "moonplan.plan",
    "wrap": "moonplan.adapters",
    "wrap_experts": "moonplan.adapters",
    "wrap_model": "moonplan.adapters",
}
"""Public function or class -> the module that defines it (loaded on first access)."""

__all__ = [  # the keys of NAMES (tests/test_package.py checks it)
    "MoEConfig",
    "MoonMoE",
    "Plan",
    "PlanError",
    "Route",
    "check_plan",
    "home_map",
    "plan",
    "profile",
    "rehome_model",
    "route",
    "wrap",
    "wrap_experts",
    "wrap_model",
]

SUBMODULES = {
    "adapters": "moonplan.adapters",
    "baselines": "moonplan.baselines",
    "checkpoint": "moonplan.adapters.checkpoint",
    "cli": "moonplan.cli",
    "comm": "moonplan.comm",
    "core": "moonplan.core",
    "cost": "moonplan.cost",
    "demo": "moonplan.cli.demo",
    "errors": "moonplan.errors",
    "layer": "moonplan.layer",
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
    if name in NAMES:
        value = getattr(importlib.import_module(NAMES[name]), name)
        globals()[name] = value  # later accesses skip this function
        return value
    if name in SUBMODULES:
        return importlib.import_module(SUBMODULES[name])
    raise AttributeError(f"module 'moonplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(NAMES) | set(SUBMODULES))


class _Package(types.ModuleType):
    """The ``moonplan`` module's type: public names win over same-named subpackages.

    Importing a subpackage binds it on its parent (``setattr(moonplan, "plan", <package
    moonplan.plan>)``); that binding is skipped for a name of :data:`NAMES`, so
    ``moonplan.plan`` stays the function whichever module imported the package first.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in NAMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
