"""Public testing helpers: the invariant checker, random slot tables and hypothesis
strategies.

The strategies (``counts``, ``plan_options``, ``counts_and_options``, ``allocs``) load lazily,
on first access, because they need ``hypothesis`` (the ``test`` extra) and
``import moonplan`` must not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moonplan.testing.invariants import check_plan
from moonplan.testing.tables import random_slot_tables

if TYPE_CHECKING:
    from moonplan.testing.strategies import (
        COUNTS_FAMILIES,
        allocs,
        counts,
        counts_and_options,
        plan_options,
    )

_STRATEGIES = ("COUNTS_FAMILIES", "allocs", "counts", "counts_and_options", "plan_options")

__all__ = [
    "COUNTS_FAMILIES",
    "allocs",
    "check_plan",
    "counts",
    "counts_and_options",
    "plan_options",
    "random_slot_tables",
]


def __getattr__(name: str) -> Any:
    if name in _STRATEGIES:
        from moonplan.testing import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
