"""Names of the phases of a MoonMoE step, and how they group into sequences.

A *sequence* is a run of phases that follow each other without other work in
between on a rank: the forward (``counts`` .. ``combine``) and the backward
(``combine_backward`` .. ``grad_reduce``); a user region is a sequence of its own.
"""

from __future__ import annotations

FORWARD_PHASES = ("counts", "plan", "prefetch", "dispatch", "experts", "combine")
"""Forward phases, in execution order (``counts``: the counts all-gather)."""

BACKWARD_PHASES = ("combine_backward", "experts_backward", "dispatch_backward", "grad_reduce")
"""Backward phases, in execution order."""

PHASES = FORWARD_PHASES + BACKWARD_PHASES
"""Every phase of a MoonMoE step."""

USER_LAYER = -1
"""Layer index of regions timed with ``Profiler.phase`` in user code."""


def sequence_of(name: str) -> str:
    """``"forward"``, ``"backward"``, or ``name`` itself for a user region."""
    if name in FORWARD_PHASES:
        return "forward"
    return "backward" if name in BACKWARD_PHASES else name
