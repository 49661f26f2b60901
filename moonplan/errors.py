"""Errors raised by moonplan."""


class PlanError(ValueError):
    """Bad planner input, or a plan that breaks one of the invariants of ``docs/design.md`` §3.

    The message says what is wrong and where (which rank, expert or invariant).
    """
