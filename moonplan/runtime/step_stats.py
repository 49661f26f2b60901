"""``StepStats``: the host figures of one MoE step (``layer.last_stats``).

Legend: none (host values only; phase times in seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    """Figures of one step (host values; phase times in seconds).

    ``phases`` has ``counts``, ``plan``, ``dispatch``, ``experts``, ``combine`` and
    ``prefetch_exposed`` (time the step waited for the weight prefetch: submitting it,
    and the experts waiting for it) on the critical path, and ``prefetch`` (the
    prefetch's own duration, measured where it runs: in the background with an
    overlapped schedule) after the forward; it gains ``combine_backward``,
    ``experts_backward``, ``dispatch_backward``, ``grad_reduce_exposed`` and
    ``grad_reduce`` (the same pair for the replica-gradient reduce) once the step's
    backward has run.

    ``direct_reads``: replicas whose weights this rank read from their home rank this
    step (beyond its slots); ``policy``: the balance policy of the step's plan;
    ``predicted``: the cost model's predicted step seconds per candidate policy
    (empty when the step was not planned with a cost model).
    """

    copies: int = 0
    new_copies: int = 0
    prefetched_rows: int = 0
    static_max_over_mean: float = 1.0
    planned_max_over_mean: float = 1.0
    phases: dict[str, float] = field(default_factory=dict)
    direct_reads: int = 0
    policy: str = "exact"
    predicted: dict[str, float] = field(default_factory=dict)
