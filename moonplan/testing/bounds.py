"""The least largest load a set of holders allows: the bound the ``resident`` candidate
is measured against (``moonplan.plan.choice.resident``).

Legend: R ranks, E experts; ``T[e]`` records of expert ``e``; ``holders[e]`` the ranks that
may run ``e`` (its home and the ranks whose serving slots hold it).

With records divisible, the least largest rank load is the least ``L`` for which a flow
from every expert to its holders, at most ``L`` into each rank, carries every record: a
max-flow question (``networkx``, which ships with torch), answered here in whole records
by bisection over ``L`` (so the bound is the integer one, ``ceil`` of the divisible one or
more).
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx


def least_largest_load(T: Sequence[int], holders: Sequence[Sequence[int]], R: int) -> int:
    """The least largest rank load, in whole records, over allocations that give each
    expert's ``T[e]`` records to its ``holders[e]`` (each a list of ranks ``< R``)."""
    total = sum(T)
    lo, hi = -(-total // R), total
    while lo < hi:
        mid = (lo + hi) // 2
        if _carries(T, holders, R, mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _carries(T: Sequence[int], holders: Sequence[Sequence[int]], R: int, cap: int) -> bool:
    """Whether every record fits with at most ``cap`` records a rank."""
    g = nx.DiGraph()
    for e, t in enumerate(T):
        if t:
            g.add_edge("s", ("e", e), capacity=t)
            for r in holders[e]:
                g.add_edge(("e", e), ("r", r))  # no capacity: unbounded
    for r in range(R):
        g.add_edge(("r", r), "t", capacity=cap)
    return bool(nx.maximum_flow_value(g, "s", "t") >= sum(T))
