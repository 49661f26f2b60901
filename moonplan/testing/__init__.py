"""Public testing helpers: the invariant checker and hypothesis strategies."""

from moonplan.testing.invariants import check_plan

__all__ = ["check_plan"]
