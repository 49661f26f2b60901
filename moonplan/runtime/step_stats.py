"""``StepStats``: the host figures of one MoE step (``layer.last_stats``).

Legend: none (host values only; phase times in seconds).

``print(layer.last_stats)`` shows them as a small table with units (phase times in
milliseconds); ``repr`` keeps the dataclass form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BACKGROUND = ("prefetch", "grad_reduce")
"""Phases timed where they run, beside the others (``moonplan.profiling.phases``)."""


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
    (empty when the step was not planned with a cost model); ``choice``: how
    ``balance="auto"`` chose the step's plan, ``"full"`` (it scored every candidate),
    ``"exit"`` (its early exit: static EP, by a bound from the counts), ``"lookup"``
    (a lookup of the slots served without a planner call, where calls do not pay),
    ``"exact"`` (the exact kernel, where exact balance every step is predicted fastest
    over the window) or ``"none"`` (``balance="exact"``, ``"off"`` and auto's warm-up).

    ``records``: this rank's ``(token, k)`` records; ``rows_sent``: rows its dispatch
    sent (one per record, or one per ``(token, destination rank)`` on a token-row
    transport; its own rank included); ``bytes_sent``: bytes it sent in dispatch and
    combine (rows, per-record words, rows returned as executing rank); the backward
    moves the same the other way (``moonplan.runtime.transports.base.StepState``).

    ``heap``: the symmetric heap under the step's transport, ``"shm"``, ``"ipc"`` or
    ``"nvshmem"`` (``moonplan.comm.heap_factory``), ``""`` on a transport without one.
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
    choice: str = "none"
    records: int = 0
    rows_sent: int = 0
    bytes_sent: int = 0
    heap: str = ""

    @property
    def rows_per_record(self) -> float:
        """``rows_sent / records`` (1.0 with no records)."""
        return self.rows_sent / self.records if self.records else 1.0

    def __str__(self) -> str:
        """A two-column table (figure, value with its unit); phases in milliseconds in the
        order they ran, background ones marked."""
        from moonplan.tables import render

        rows = [
            ["policy", self.policy],
            ["replica copies", f"{self.copies} ({self.new_copies} new)"],
            ["prefetched", f"{self.prefetched_rows} experts into slots"],
            ["direct reads", f"{self.direct_reads} experts"],
            [
                "load max/mean",
                f"static EP {self.static_max_over_mean:.3f} -> "
                f"planned {self.planned_max_over_mean:.3f}",
            ],
            ["records", str(self.records)],
            ["rows sent", f"{self.rows_sent} ({self.rows_per_record:.3f} per record)"],
            ["bytes sent", f"{self.bytes_sent / 2**10:.1f} KiB"],
        ]
        rows += [
            [f"{name} (background)" if name in BACKGROUND else name, f"{1e3 * sec:.3f} ms"]
            for name, sec in self.phases.items()
        ]
        if self.predicted:
            best = sorted(self.predicted.items(), key=lambda kv: kv[1])
            rows.append(["predicted step", ", ".join(f"{n} {1e3 * sec:.3f} ms" for n, sec in best)])
        return render(["step figure", "value"], rows)
