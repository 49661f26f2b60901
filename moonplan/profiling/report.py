"""``ProfileReport``: every rank's phase spans, per-rank and critical-path figures, table, JSON.

Legend:
    R ranks, L layers (profiled MoonMoE layers, plus ``USER_LAYER`` for user regions),
    T steps (step ``t`` is the ``t``-th forward of each layer), P phases (``report.phases``)
    d_RLTP  seconds each rank spent in each phase of each layer's step (spans summed)

The figures are defined so that they add up:

* a rank's *step* is the sum of its foreground phases over layers (``step_RT``);
* the *critical path* of step ``t`` is its slowest rank, ``argmax_r step_RT[r, t]``, and
  a phase's critical time is that rank's time in it (``crit_TP``). The phases' critical
  times add up to the slowest rank's step, so their shares add up to 100%;
* the *wall* step is measured on the common clock, from the first rank's start to the
  last rank's end of each sequence (forward, backward, user region) of each layer,
  summed. It is at least the slowest rank's step; the difference is time ranks spent
  waiting for each other between sequences.

The per-phase maximum over ranks (``phase_max_TP``, in the JSON) is not additive: a rank
that finishes a phase early waits in the next collective, so the phases' maxima can add
up to more than any rank's step, and more than the wall step.

Background phases (``prefetch``, ``grad_reduce``: timed in the worker thread
or on the side stream that ran them) overlap the others; they are left out of step sums
and wall times, and their share (in parentheses) is against the step. Each has an
``*_exposed`` twin on the critical path: submitting the job and waiting for it. The
table reports the slowest rank's exposed time as a share of its step, and the part of
every rank's jobs that surely ran beside other work: ``max(0, job - exposed) / job``
summed over ranks and steps, a lower bound (a rank's wait is part of its exposed time),
never above 100%.
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

    def rank_step_s(self) -> np.ndarray:
        """``[R, T]`` float64 seconds: each rank's step, the sum of its foreground phases."""
        return self.rank_phase_s()[:, :, self.foreground()].sum(2)

    def slowest_rank(self) -> np.ndarray:
        """``[T]`` int64: the rank with the longest step in each step (the lowest on ties)."""
        return self.rank_step_s().argmax(0)

    def critical_phase_s(self) -> np.ndarray:
        """``[T, P]`` float64 seconds: each step's slowest rank's phase times (layers summed).

        Its foreground columns add up to that rank's step: ``step_RT.max(0)``.
        """
        rank_RTP = self.rank_phase_s()
        return rank_RTP[self.slowest_rank(), np.arange(self.steps), :]

    def phase_max_s(self) -> np.ndarray:
        """``[T, P]`` float64 seconds: per layer and step the slowest rank *in each phase*,
        summed over layers. Not additive: its rows can add up to more than any rank's step
        (waiting moves between phases), so the table does not use it."""
        d = self.durations()
        return d.max(0).sum(0) if d.size else np.zeros((self.steps, len(self.phases)))

    def wall_step_s(self) -> np.ndarray:
        """``[T]`` float64 seconds: per step, summed over layers and sequences, the time from
        the first rank's first span to the last rank's last span (common clock; background
        spans left out: they ran beside the sequence, and may start before it)."""
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
        slowest rank's step), ``rank_mean_ms`` (``R`` values: each rank's mean per step)
        and ``rank_max_over_mean``. Phases use the critical path (:meth:`critical_phase_s`:
        the foreground phases' ``mean_ms`` add up to ``"step"``'s, their shares to 1);
        ``"step"`` is the slowest rank's step; ``"wall"`` :meth:`wall_step_s`.
        """
        crit_TP, rank_RTP = self.critical_phase_s(), self.rank_phase_s()
        rank_RT = self.rank_step_s()
        slowest_T = rank_RT.max(0) if rank_RT.size else np.zeros(self.steps)
        total = float(slowest_T.sum()) or 1.0
        out: dict[str, dict[str, Any]] = {}
        for name in self.present:
            p = self.phases.index(name)
            share = float(crit_TP[:, p].sum()) / total
            out[name] = _figures(crit_TP[:, p], rank_RTP[:, :, p], share)
        out["step"] = _figures(slowest_T, rank_RT, 1.0)
        out["wall"] = _figures(self.wall_step_s(), rank_RT, 1.0)
        return out

    def exposure(self, name: str) -> dict[str, float] | None:
        """A background job against its ``*_exposed`` twin.

        Returns ``None`` unless both were recorded and some job took time, else:

        * ``exposed_ms``: the critical path's exposed time, the mean per step of the
          slowest rank's, and ``exposed_share``, its part of the slowest rank's step;
        * ``job_ms``: the job's own time, the mean over ranks and steps;
        * ``hidden_at_least``: ``sum max(0, job - exposed) / sum job`` over every rank and
          step, each rank's job against its own exposed time: the part of the jobs that
          surely ran beside other work (a rank's wait for its job is part of its exposed
          time).

        Both fractions lie in ``[0, 1]``.
        """
        if name not in self.present or f"{name}_exposed" not in self.present:
            return None
        job, exposed = self.phases.index(name), self.phases.index(f"{name}_exposed")
        rank_RTP = self.rank_phase_s()
        job_RT, exposed_RT = rank_RTP[:, :, job], rank_RTP[:, :, exposed]
        if float(job_RT.sum()) <= 0:
            return None
        crit_exposed_T = self.critical_phase_s()[:, exposed]
        step = float(self.rank_step_s().max(0).sum())
        return {
            "exposed_ms": float(1e3 * crit_exposed_T.mean()),
            "job_ms": float(1e3 * job_RT.mean()),
            "exposed_share": float(crit_exposed_T.sum()) / step if step > 0 else 0.0,
            "hidden_at_least": float(np.maximum(job_RT - exposed_RT, 0).sum() / job_RT.sum()),
        }

    def table(self) -> str:
        """A text table: one row per phase and two for the step (milliseconds), then one
        line per background job, the rows per record and the slowest and fastest rank."""
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
        lines += self._background_lines()
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

    def _background_lines(self) -> list[str]:
        lines = []
        for name in BACKGROUND_PHASES:
            x = self.exposure(name)
            if x is not None:
                lines.append(
                    f"{name}: {x['exposed_ms']:.3f} ms exposed ({100 * x['exposed_share']:.1f}% "
                    f"of the step); its jobs: {x['job_ms']:.3f} ms a rank in the background, "
                    f"at least {100 * x['hidden_at_least']:.0f}% of them hidden"
                )
        return lines

    def describe(self) -> str:
        """One line: ranks, layers, steps, clock, and how the phase rows add up."""
        layers = sum(1 for layer in self.layers if layer != USER_LAYER)
        sync = ", barrier before every step" if self.aligned else ""
        return (
            f"{self.ranks} ranks, {layers} MoE layer(s), {self.steps} steps; "
            f"clock: {self.clock}{sync}; phases of each step's slowest rank (they add up)"
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: the figures, per-step critical times (the slowest rank's,
        additive) and per-phase maxima over ranks (not additive), per-rank step times,
        background exposure and every span (``[rank, layer, step, phase index, start s,
        end s]``)."""
        crit_TP, max_TP = self.critical_phase_s(), self.phase_max_s()
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
            "slowest_rank": self.slowest_rank().tolist(),
            "critical_phase_ms": {
                n: (1e3 * crit_TP[:, self.phases.index(n)]).tolist() for n in self.present
            },
            "phase_max_ms": {
                n: (1e3 * max_TP[:, self.phases.index(n)]).tolist() for n in self.present
            },
            "rank_step_ms": (1e3 * self.rank_step_s()).tolist(),
            "background": list(BACKGROUND_PHASES),
            "exposure": {n: x for n in BACKGROUND_PHASES if (x := self.exposure(n)) is not None},
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
