"""Baselines moonplan is measured against, on the same counts and metrics."""

from moonplan.baselines.capacity import CapacityPolicy
from moonplan.baselines.compare import compare_policies
from moonplan.baselines.eplb import EPLBPolicy
from moonplan.baselines.metrics import (
    balancedness,
    balancedness_per_layer,
    balancedness_summed,
    expert_maxvio,
    imbalance,
    maxvio,
    summarize,
)
from moonplan.baselines.moonep_greedy import copies_lower_bound, moonep_greedy_alloc, replica_count
from moonplan.baselines.policies import (
    POLICY_NAMES,
    GreedyPolicy,
    MoonplanAutoPolicy,
    MoonplanPolicy,
    Policy,
    PolicyStep,
    StaticPolicy,
    make_policy,
)
from moonplan.baselines.static_ep import max_over_mean, static_alloc

__all__ = [
    "POLICY_NAMES",
    "CapacityPolicy",
    "EPLBPolicy",
    "GreedyPolicy",
    "MoonplanAutoPolicy",
    "MoonplanPolicy",
    "Policy",
    "PolicyStep",
    "StaticPolicy",
    "balancedness",
    "balancedness_per_layer",
    "balancedness_summed",
    "compare_policies",
    "copies_lower_bound",
    "expert_maxvio",
    "imbalance",
    "make_policy",
    "max_over_mean",
    "maxvio",
    "moonep_greedy_alloc",
    "replica_count",
    "static_alloc",
    "summarize",
]
