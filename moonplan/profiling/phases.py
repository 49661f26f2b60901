"""Names of the phases of a MoonMoE step, and how they group into sequences.

A *sequence* is a run of phases that follow each other without other work in
between on a rank: the forward (``counts`` .. ``combine``) and the backward
(``combine_backward`` .. ``grad_reduce_exposed``); a user region is a sequence of its
own. *Background* phases run beside a sequence (a worker thread or side stream)
and belong to it, but overlap its phases: they are not part of step sums.
"""

from __future__ import annotations

FORWARD_PHASES = (
    "counts",
    "plan",
    "prefetch_exposed",
    "dispatch",
    "experts",
    "combine",
    "prefetch",
)
"""Forward phases (``counts``: the counts all-gather; ``prefetch_exposed``: submitting
the prefetch and the experts' wait for it; ``prefetch``: its own time, background)."""

BACKWARD_PHASES = (
    "combine_backward",
    "experts_backward",
    "dispatch_backward",
    "grad_reduce_exposed",
    "grad_reduce",
)
"""Backward phases (``grad_reduce``: the replica-gradient reduce's own time, background)."""

BACKGROUND_PHASES = ("prefetch", "grad_reduce")
"""Phases timed where they run, beside the others: left out of step sums, shares and
wall times."""

PHASES = FORWARD_PHASES + BACKWARD_PHASES
"""Every phase of every MoonMoE step."""

USER_LAYER = -1
"""Layer index of regions timed with ``Profiler.phase`` in user code."""


def sequence_of(name: str) -> str:
    """``"forward"``, ``"backward"``, or ``name`` itself for a user region."""
    if name in FORWARD_PHASES:
        return "forward"
    return "backward" if name in BACKWARD_PHASES else name
