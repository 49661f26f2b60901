"""PNG plots of policies and simulated step times (matplotlib, imported only when plotting).

Install the optional dependency with ``pip install matplotlib`` (or the ``plot``
extra). Every function writes one PNG to ``path`` and returns the path.

* :func:`plot_rank_loads`: records per rank of each policy on one step;
* :func:`plot_balancedness`: balancedness (mean/max) of each policy over steps;
* :func:`plot_vs_skew`, :func:`plot_vs_ep`: step time / force-balanced ideal
  against skew (one panel per EP size) or against EP size (one panel per skew);
  :func:`plot_policies`: the same ratio per policy on a recorded trace;
  :func:`plot_sweep` picks between them from the rows.

Each policy's line has the style it registered (``moonplan.baselines.registry``).
Axes carry their units and a labelled tick at every simulated point; the ratio axis is
linear with 5-8 labelled ticks. ``figure_*`` build the figures without saving them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moonplan.baselines.policy_base import PolicyStep
from moonplan.baselines.registry import info

DPI = 100


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` with the non-interactive Agg backend, or a clear error."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "plots need matplotlib: pip install matplotlib (or pip install 'moonplan[plot]')"
        ) from None
    return plt


def _save(fig: Any, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    require_matplotlib().close(fig)
    return out


def plot_rank_loads(
    steps: Sequence[PolicyStep], path: str | Path, title: str = "records per rank, one step"
) -> Path:
    """Grouped bars: records each rank executes under each policy (dashed line: mean)."""
    plt = require_matplotlib()
    R = int(steps[0].load_R.numel())
    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.8 / len(steps)
    for i, s in enumerate(steps):
        xs = [r + (i - (len(steps) - 1) / 2) * width for r in range(R)]
        ax.bar(xs, s.load_R.tolist(), width=width, label=s.name)
    mean = float(steps[0].alloc_ER.sum() + steps[0].dropped) / R
    ax.axhline(mean, color="black", linestyle="--", linewidth=1, label="mean offered")
    ax.set(xlabel="rank", ylabel="records executed", title=title, xticks=list(range(R)))
    ax.legend(fontsize=7, ncol=3)
    return _save(fig, path)


def plot_balancedness(
    series: Mapping[str, Sequence[float]], path: str | Path, title: str = "balancedness"
) -> Path:
    """One line per policy: balancedness (mean/max records per rank) at each step."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, values in series.items():
        ax.plot(range(len(values)), list(values), marker=".", label=name)
    ax.set(xlabel="step", ylabel="mean / max records per rank", title=title, ylim=(0, 1.05))
    ax.legend(fontsize=7, ncol=3)
    return _save(fig, path)


def _grouped(rows: Sequence[dict[str, Any]], key: str) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r[key], []).append(r)
    return out


def _skew_x(r: dict[str, Any]) -> float:
    target = r.get("maxvio_target")
    return float(target) if target is not None else float(r["sigma"])


def _recorded(r: dict[str, Any]) -> bool:
    """A row of a recorded trace (``--counts``): no generated skew."""
    return r.get("maxvio_target") is None and r.get("sigma") is None


def style(policy: str) -> tuple[str, str]:
    """``(line style, marker)`` of ``policy``: what it registered
    (``moonplan.baselines.registry``), or a solid line with dots for a name nobody registered."""
    try:
        return info(policy).style
    except ValueError:
        return ("-", ".")


Y_LABEL = "step time / force-balanced ideal (x)"


LOG_ABOVE = 12.0
"""Ratios above this make the axis logarithmic (ticks 1x 2x 5x 10x 20x ...)."""


def _y_axis(ax: Any, bottom: float = 0.9) -> None:
    """The ratio axis, once every panel sharing it is drawn: linear from ``bottom`` with
    5-8 labelled ticks (``1x``, ``1.5x``, ...), or log with labelled 1-2-5 ticks when a
    ratio exceeds :data:`LOG_ABOVE`."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    lo, hi = ax.get_ylim()
    if hi > LOG_ABOVE and bottom > 0:
        ax.set_yscale("log")
        ax.set_ylim(bottom=min(bottom, lo) if lo > 0 else bottom, top=hi * 1.1)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(bottom=min(bottom, lo), top=hi)
        ax.yaxis.set_major_locator(MaxNLocator(nbins=7, steps=[1, 2, 2.5, 5, 10]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.grid(True, alpha=0.3)


def _lines(ax: Any, rows: Sequence[dict[str, Any]], x: Any) -> None:
    for name, pts in _grouped(rows, "policy").items():
        pts = sorted(pts, key=x)
        line, marker = style(name)
        ys = [p["rel_ideal"] for p in pts]
        ax.plot([x(p) for p in pts], ys, linestyle=line, marker=marker, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    xs = sorted({x(p) for p in rows})
    ax.set_xticks(xs, [f"{v:g}" for v in xs])  # a labelled tick at every simulated point


def _panels(n: int) -> tuple[Any, list[Any]]:
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.8), squeeze=False, sharey=True)
    return fig, list(axes[0])


def figure_vs_skew(rows: Sequence[dict[str, Any]], title: str = "") -> Any:
    """The figure of :func:`plot_vs_skew` (not saved)."""
    by_ep = _grouped(rows, "ranks")
    fig, axes = _panels(len(by_ep))
    label = "MaxVio target" if rows[0].get("maxvio_target") is not None else "lognormal sigma"
    for ax, (R, pts) in zip(axes, sorted(by_ep.items()), strict=True):
        _lines(ax, pts, _skew_x)
        ax.set(xlabel=label, title=f"{title} EP={R}".strip())
    _y_axis(axes[0])  # shared by every panel, now that all are drawn
    axes[0].set_ylabel(Y_LABEL)
    axes[-1].legend(fontsize=7)
    return fig


def figure_vs_ep(rows: Sequence[dict[str, Any]], title: str = "") -> Any:
    """The figure of :func:`plot_vs_ep` (not saved)."""
    by_skew = _grouped([{**r, "_skew": _skew_x(r)} for r in rows], "_skew")
    fig, axes = _panels(len(by_skew))
    name = "MaxVio" if rows[0].get("maxvio_target") is not None else "sigma"
    for ax, (skew, pts) in zip(axes, sorted(by_skew.items()), strict=True):
        ax.set_xscale("log", base=2)
        _lines(ax, pts, lambda p: p["ranks"])
        ax.minorticks_off()
        ax.set(xlabel="EP size (ranks)", title=f"{title} {name} {skew:g}".strip())
    _y_axis(axes[0])
    axes[0].set_ylabel(Y_LABEL)
    axes[-1].legend(fontsize=7)
    return fig


def figure_policies(rows: Sequence[dict[str, Any]], title: str = "") -> Any:
    """Bars: each policy's mean step time / ideal on a recorded trace (one EP size)."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(rows) + 1.5), 3.8))
    names = [r["policy"] for r in rows]
    ax.bar(range(len(rows)), [r["rel_ideal"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
    EP = rows[0].get("ranks")
    ax.set(ylabel=Y_LABEL, title=f"{title} recorded trace, EP={EP}".strip())
    _y_axis(ax, bottom=0.0)
    return fig


def plot_vs_skew(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Step time / ideal against skew (sigma, or the MaxVio target); a panel per EP size."""
    return _save(figure_vs_skew(rows, title), path)


def plot_vs_ep(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Step time / ideal against EP size (log2 axis, a tick per size); a panel per skew."""
    return _save(figure_vs_ep(rows, title), path)


def plot_policies(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Step time / ideal per policy on a recorded trace (``moonplan simulate --counts``)."""
    return _save(figure_policies(rows, title), path)


def plot_sweep(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """:func:`plot_policies` for a recorded trace; else :func:`plot_vs_skew` when the rows
    hold several skews, else :func:`plot_vs_ep`."""
    if not rows:
        raise ValueError("nothing to plot: no rows")
    if any(_recorded(r) for r in rows):
        return plot_policies(rows, path, title)
    skews = {_skew_x(r) for r in rows}
    return plot_vs_skew(rows, path, title) if len(skews) > 1 else plot_vs_ep(rows, path, title)
