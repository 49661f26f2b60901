"""Stacked bars of the mean phase times per rank (and the critical path) as a PNG.

Every bar adds up: a rank's bar is its mean step, the last bar the mean of each step's
slowest rank (``ProfileReport.critical_phase_s``), and a dashed line marks the mean wall
step, which no bar exceeds.

Legend: R ranks, P phases present. Needs matplotlib (imported when called; not a
dependency of moonplan). Uses the object API (no pyplot state, no display needed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moonplan.profiling.phases import BACKGROUND_PHASES
from moonplan.profiling.report import ProfileReport


def _figure_class() -> type:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            f"plotting a profile needs matplotlib ({exc}); install it with `pip install matplotlib`"
        ) from None
    return Figure


def plot_phase_bars(report: ProfileReport, path: str | Path, *, title: str = "") -> Path:
    """Write a PNG: one bar per rank plus one of each step's slowest rank, stacked by
    phase (foreground phases only: background ones overlap them), and the wall step.

    Each segment is the phase's mean time per step in milliseconds (layers summed); the
    last bar stacks the phases of each step's slowest rank (their mean), so it is as high
    as the mean slowest-rank step; the dashed line is the mean wall step.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    Figure = _figure_class()
    names = [n for n in report.present if n not in BACKGROUND_PHASES]  # they overlap
    idx = [report.phases.index(n) for n in names]
    rank_RP = 1e3 * report.rank_phase_s().mean(1)[:, idx] if report.steps else np.zeros((0, 0))
    crit_P = 1e3 * report.critical_phase_s().mean(0)[idx] if report.steps else np.zeros(0)
    bars_XP = (
        np.vstack([rank_RP, crit_P[None, :]]) if len(names) else np.zeros((report.ranks + 1, 0))
    )
    labels = [f"rank {r}" for r in range(report.ranks)] + ["slowest rank\nper step"]
    fig = Figure(figsize=(max(7.0, 3.0 + 0.6 * len(labels)), 4.5), layout="constrained")
    ax = fig.add_subplot()
    colors = _colors(len(names))
    bottom = np.zeros(len(labels))
    for j, name in enumerate(names):
        ax.bar(labels, bars_XP[:, j], bottom=bottom, label=name, color=colors[j], width=0.7)
        bottom += bars_XP[:, j]
    if report.steps:
        wall = 1e3 * float(report.wall_step_s().mean())
        ax.axhline(wall, color="0.3", linestyle="--", linewidth=1, label="wall step")
        ax.set_ylim(0, 1.08 * max(wall, float(bottom.max(initial=0.0))) or 1.0)
    ax.set_ylabel("mean time per step (ms)")
    ax.set_title(title or f"MoE phases per rank: mean of {report.steps} steps ({report.clock})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    ax.tick_params(axis="x", labelrotation=45 if len(labels) > 9 else 0)
    p = Path(path)
    fig.savefig(p, dpi=120)
    return p


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]
