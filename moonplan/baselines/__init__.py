"""Baselines moonplan is measured against, on the same counts and metrics."""

from moonplan.baselines.moonep_greedy import copies_lower_bound, moonep_greedy_alloc, replica_count
from moonplan.baselines.static_ep import max_over_mean, static_alloc

__all__ = [
    "copies_lower_bound",
    "max_over_mean",
    "moonep_greedy_alloc",
    "replica_count",
    "static_alloc",
]
