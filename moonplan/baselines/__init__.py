"""Baselines moonplan is measured against, on the same counts and metrics.

Importing the package imports every module in it, so each built-in policy registers
itself (``register(PolicyInfo(...))`` next to its class) in
``moonplan.baselines.registry``: a new policy module needs no line here. Build one with
:func:`make_policy`, list them with :func:`names`.
"""

import importlib
import pkgutil

from moonplan.baselines.compare import compare_policies
from moonplan.baselines.moonep_greedy import copies_lower_bound, moonep_greedy_alloc, replica_count
from moonplan.baselines.policy_base import Policy, PolicyStep
from moonplan.baselines.registry import PolicyInfo, info, make_policy, names, register, registered
from moonplan.baselines.static_ep import max_over_mean, static_alloc


def _import_policy_modules() -> None:
    """Import every module of this package (each policy module registers its policies)."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_policy_modules()

POLICY_NAMES = names()
"""The built-in policies' names in report order (``names()`` also lists later registrations)."""

__all__ = [
    "POLICY_NAMES",
    "Policy",
    "PolicyInfo",
    "PolicyStep",
    "compare_policies",
    "copies_lower_bound",
    "info",
    "make_policy",
    "max_over_mean",
    "moonep_greedy_alloc",
    "names",
    "register",
    "registered",
    "replica_count",
    "static_alloc",
]
