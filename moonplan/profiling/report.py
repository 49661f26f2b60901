"""``ProfileReport``: every rank's phase spans, per-rank and critical-path figures, table, JSON.

Legend:
    R ranks, L layers (profiled MoonMoE layers, plus ``USER_LAYER`` for user regions),
    T steps (step ``t`` is the ``t``-th forward of each layer), P phases (``report.phases``)
    d_RLTP  seconds each rank spent in each phase of each layer's step (spans summed)

Critical path of a phase: per layer and step the slowest rank's time (``max``
over ranks), summed over layers: ``crit_TP = d_RLTP.max(0).sum(0)``. Percentiles
(p50, p90) are over steps; a phase's *share* is its part of ``crit_TP.sum()``
(shares sum to 1). The sum of the phases' maxima overstates the step: a rank that
finishes a phase early waits in the next collective, so waiting moves between
phases. Two step figures are therefore reported: the slowest rank's step
(``max`` over ranks of its phase sum) and the *wall* step, measured on the common
clock from the first rank's start to the last rank's end of each sequence
(forward, backward, user region) of each layer, summed.

Background phases (``prefetch``, ``grad_reduce``, ``choice``: timed in the worker
thread or on the side stream that ran them) overlap the others; they are left out of
the step sums, of the wall times and of the shares' total (their share is still
reported against that total), and the table adds what fraction of each was exposed on
the critical path (``prefetch_exposed / prefetch``, ``choice_exposed / choice``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from moonplan.profiling.phases import BACKGROUND_PHASES, USER_LAYER, sequence_of
from moonplan.tables import render


class Span(NamedTuple):
    """One timed phase: ``rank``, ``layer``, ``step``, ``phase`` (index into the report's
    names), ``start`` and ``end`` in seconds from the profiler's common origin."""

    rank: int
    layer: int
    step: int
    phase: int
    start: float
    end: float


@dataclass(frozen=True)
class ProfileReport:
    """Every rank's spans of one profiling run (identical on every rank).

    Attributes:
        ranks: ``R``.
        phases: phase names; ``Span.phase`` indexes it (forward, backward, then user names).
        spans: all spans, by rank then recording order.
        clock: ``"cpu perf_counter"`` or ``"cuda events"``.
        aligned: whether every step began with a barrier.
        traffic: ``(records, rows sent)`` of every profiled step of every rank
            (``StepStats.records``, ``StepStats.rows_sent``).
    """

    ranks: int
    phases: tuple[str, ...]
    spans: tuple[Span, ...]
    clock: str
    aligned: bool = False
    traffic: tuple[int, int] = (0, 0)

    @property
    def rows_per_record(self) -> float | None:
        """Rows dispatch sent per record (1 per record; less with token rows), or
        ``None`` when no step with records was profiled."""
        records, rows = self.traffic
        return rows / records if records else None

    # ---- arrays -------------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        """Layer indices present, ascending (``USER_LAYER`` first when present)."""
        return tuple(sorted({s.layer for s in self.spans}))

    @property
    def steps(self) -> int:
        """``T``: one more than the largest step index (0 without spans)."""
        return 1 + max((s.step for s in self.spans), default=-1)

    @property
    def present(self) -> tuple[str, ...]:
        """Names of the phases that have at least one span, in :attr:`phases` order."""
        seen = {s.phase for s in self.spans}
        return tuple(n for i, n in enumerate(self.phases) if i in seen)

    def durations(self) -> np.ndarray:
        """``d_RLTP`` float64 seconds (spans of the same phase and step summed)."""
        col = {layer: i for i, layer in enumerate(self.layers)}
        d = np.zeros((self.ranks, len(col), self.steps, len(self.phases)))
        for s in self.spans:
            d[s.rank, col[s.layer], s.step, s.phase] += s.end - s.start
        return d

    def foreground(self) -> np.ndarray:
        """``[P]`` bool: phases on the critical path (every phase but the background ones)."""
        return np.array([n not in BACKGROUND_PHASES for n in self.phases], dtype=bool)

    def rank_phase_s(self) -> np.ndarray:
        """``[R, T, P]`` float64 seconds: each rank's phase times per step (layers summed)."""
        return self.durations().sum(1)

    def critical_phase_s(self) -> np.ndarray:
        """``[T, P]`` float64 seconds: the slowest rank per layer, summed over layers."""
        d = self.durations()
        return d.max(0).sum(0) if d.size else np.zeros((self.steps, len(self.phases)))

    def wall_step_s(self) -> np.ndarray:
        """``[T]`` float64 seconds: per step, summed over layers and sequences, the time from
        the first rank's first span to the last rank's last span (common clock; background
        spans left out: the choice made ahead ran beside the previous step)."""
        first: dict[tuple[int, int, str], float] = {}
        last: dict[tuple[int, int, str], float] = {}
        for s in self.spans:
            if self.phases[s.phase] in BACKGROUND_PHASES:  # beside a sequence, maybe before it
                continue
            key = (s.layer, s.step, sequence_of(self.phases[s.phase]))
            first[key] = min(first.get(key, s.start), s.start)
            last[key] = max(last.get(key, s.end), s.end)
        wall_T = np.zeros(self.steps)
        for key, t0 in first.items():
            wall_T[key[1]] += last[key] - t0
        return wall_T

    # ---- figures ------------------------------------------------------------------------
    def summary(self) -> dict[str, dict[str, Any]]:
        """Figures in milliseconds, keyed by present phase, ``"step"`` and ``"wall"``.

        Each has ``p50_ms``, ``p90_ms``, ``mean_ms`` (over steps), ``share`` (of the
        summed phase maxima), ``rank_mean_ms`` (``R`` values: each rank's mean per step)
        and ``rank_max_over_mean``. Phases use their critical path (max over ranks);
        ``"step"`` the slowest rank's step; ``"wall"`` :meth:`wall_step_s`.
        """
        crit_TP, rank_RTP = self.critical_phase_s(), self.rank_phase_s()
        fg_P = self.foreground()
        total = float(crit_TP[:, fg_P].sum()) or 1.0
        out: dict[str, dict[str, Any]] = {}
        for name in self.present:
            p = self.phases.index(name)
            share = float(crit_TP[:, p].sum()) / total
            out[name] = _figures(crit_TP[:, p], rank_RTP[:, :, p], share)
        rank_RT = rank_RTP[:, :, fg_P].sum(2)
        slowest_T = rank_RT.max(0) if rank_RT.size else np.zeros(0)
        out["step"] = _figures(slowest_T, rank_RT, 1.0)
        out["wall"] = _figures(self.wall_step_s(), rank_RT, 1.0)
        return out

    def table(self) -> str:
        """A text table: one row per phase and one for the step (milliseconds)."""
        summ = self.summary()
        labels = {"step": "step, slowest rank", "wall": "step, wall"}
        rows = []
        for name, f in summ.items():
            share = "" if name in labels else f"{100 * f['share']:.1f}%"
            if name in BACKGROUND_PHASES:  # overlaps the others: not part of the 100%
                share = f"({share})"
            rows.append(
                [
                    labels.get(name, name),
                    f"{f['p50_ms']:.3f}",
                    f"{f['p90_ms']:.3f}",
                    f"{f['mean_ms']:.3f}",
                    share,
                    f"{f['rank_max_over_mean']:.3f}",
                ]
            )
        header = ["phase", "p50 ms", "p90 ms", "mean ms", "share", "rank max/mean"]
        lines = [self.describe(), *render(header, rows).splitlines()]
        for name in BACKGROUND_PHASES:
            exposed = summ.get(f"{name}_exposed")
            if name in summ and exposed is not None and summ[name]["mean_ms"] > 0:
                frac = exposed["mean_ms"] / summ[name]["mean_ms"]
                lines.append(
                    f"{name}: {summ[name]['mean_ms']:.3f} ms in the background, "
                    f"{exposed['mean_ms']:.3f} ms exposed ({100 * frac:.0f}%)"
                )
        if self.rows_per_record is not None:
            lines.append(
                f"rows per record: {self.rows_per_record:.3f} ({self.traffic[1]} rows sent "
                f"for {self.traffic[0]} records, all ranks and steps)"
            )
        steps = summ["step"]["rank_mean_ms"]
        if steps:
            lo, hi = int(np.argmin(steps)), int(np.argmax(steps))
            lines.append(
                f"mean step per rank: slowest rank {hi} {steps[hi]:.3f} ms, "
                f"fastest rank {lo} {steps[lo]:.3f} ms"
            )
        return "\n".join(lines)

    def describe(self) -> str:
        """One line: ranks, layers, steps and clock."""
        layers = sum(1 for layer in self.layers if layer != USER_LAYER)
        sync = ", barrier before every step" if self.aligned else ""
        return (
            f"{self.ranks} ranks, {layers} MoE layer(s), {self.steps} steps; "
            f"clock: {self.clock}{sync}; phases: slowest rank per step (critical path)"
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: the figures, per-step critical times, per-rank step times
        and every span (``[rank, layer, step, phase index, start s, end s]``)."""
        crit_TP = self.critical_phase_s()
        return {
            "ranks": self.ranks,
            "steps": self.steps,
            "layers": list(self.layers),
            "clock": self.clock,
            "aligned": self.aligned,
            "traffic": {"records": self.traffic[0], "rows_sent": self.traffic[1]},
            "rows_per_record": self.rows_per_record,
            "phases": list(self.phases),
            "summary": self.summary(),
            "wall_step_ms": (1e3 * self.wall_step_s()).tolist(),
            "critical_phase_ms": {
                n: (1e3 * crit_TP[:, self.phases.index(n)]).tolist() for n in self.present
            },
            "rank_step_ms": (1e3 * self.rank_phase_s()[:, :, self.foreground()].sum(2)).tolist(),
            "background": list(BACKGROUND_PHASES),
            "spans": [list(s) for s in self.spans],
        }


def _figures(crit_T: np.ndarray, rank_RT: np.ndarray, share: float) -> dict[str, Any]:
    """Figures of one phase from its critical times ``[T]`` and per-rank times ``[R, T]``."""
    if crit_T.size == 0:
        return {
            "p50_ms": 0.0,
            "p90_ms": 0.0,
            "mean_ms": 0.0,
            "share": share,
            "rank_mean_ms": [],
            "rank_max_over_mean": 1.0,
        }
    rank_mean_R = 1e3 * rank_RT.mean(1)
    mean = float(rank_mean_R.mean())
    return {
        "p50_ms": float(1e3 * np.percentile(crit_T, 50)),
        "p90_ms": float(1e3 * np.percentile(crit_T, 90)),
        "mean_ms": float(1e3 * crit_T.mean()),
        "share": share,
        "rank_mean_ms": rank_mean_R.tolist(),
        "rank_max_over_mean": float(rank_mean_R.max() / mean) if mean > 0 else 1.0,
    }
