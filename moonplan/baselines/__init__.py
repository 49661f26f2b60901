"""Baselines moonplan is measured against, on the same counts and metrics.

Importing the package registers every built-in policy (one module each, or a few for
moonplan's own policies in ``policies``) in ``moonplan.baselines.registry``; build one
with :func:`make_policy`, list them with :func:`names`.
"""

from moonplan.baselines import capacity, eplb, policies, static_ep  # noqa: F401 (registers them)
from moonplan.baselines.compare import compare_policies
from moonplan.baselines.moonep_greedy import copies_lower_bound, moonep_greedy_alloc, replica_count
from moonplan.baselines.policy_base import Policy, PolicyStep
from moonplan.baselines.registry import PolicyInfo, info, make_policy, names, register, registered
from moonplan.baselines.static_ep import max_over_mean, static_alloc

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
