"""PNG plots of policies and simulated step times (matplotlib, imported only when plotting).

Install the optional dependency with ``pip install matplotlib`` (or the ``plot``
extra). Every function writes one PNG to ``path`` and returns the path.

* :func:`plot_rank_loads`: records per rank of each policy on one step;
* :func:`plot_balancedness`: balancedness (mean/max) of each policy over steps;
* :func:`plot_vs_skew`, :func:`plot_vs_ep`: step time / force-balanced ideal
  against skew (one panel per EP size) or against EP size (one panel per skew);
  :func:`plot_policies`: the same ratio per policy on a recorded trace;
  :func:`plot_sweep` picks between them from the rows.

Each policy's line has the style it registered (``moonplan.baselines.registry``) and the
legend names it by its table label (``moonplan.simulate.report.label``: the legend and the
tables say the same). Axes carry their units and a labelled tick at every simulated
point; each panel (an EP size, or a skew) has a ratio axis of its own, linear with 5-8
labelled ticks, or logarithmic past :data:`LOG_ABOVE`, its limits taken from that
panel's values (no point is clipped, and a 1.02x gap stays visible next to a 20x one
in another panel). Legends stand outside the axes, right of
the last panel, so they never cover data. ``figure_*`` build the figures without saving
them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moonplan.baselines.policy_base import PolicyStep
from moonplan.baselines.registry import info
from moonplan.simulate.report import label

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
    fig, ax = plt.subplots(figsize=(10.5, 3.6))
    width = 0.8 / len(steps)
    for i, s in enumerate(steps):
        xs = [r + (i - (len(steps) - 1) / 2) * width for r in range(R)]
        ax.bar(xs, s.load_R.tolist(), width=width, label=s.name)
    mean = float(steps[0].alloc_ER.sum() + steps[0].dropped) / R
    ax.axhline(mean, color="black", linestyle="--", linewidth=1, label="mean offered")
    ax.set(xlabel="rank", ylabel="records executed", title=title, xticks=list(range(R)))
    legend_outside(ax)
    return _save(fig, path)


def plot_balancedness(
    series: Mapping[str, Sequence[float]], path: str | Path, title: str = "balancedness"
) -> Path:
    """One line per policy: balancedness (mean/max records per rank) at each step."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(9.5, 3.6))
    for name, values in series.items():
        ax.plot(range(len(values)), list(values), marker=".", label=name)
    ax.set(xlabel="step", ylabel="mean / max records per rank", title=title, ylim=(0, 1.05))
    legend_outside(ax)
    return _save(fig, path)


def legend_outside(ax: Any) -> Any:
    """``ax``'s legend outside the axes, on its right, top-aligned (it covers no data;
    ``tight_layout`` makes room for it)."""
    return ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)


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


def ratio_limits(values: Sequence[float], bottom: float = 0.9) -> tuple[float, float, bool]:
    """``(low, high, log)`` of the ratio axis for the plotted ``values``: log when a value
    exceeds :data:`LOG_ABOVE` (and all are positive), else linear. It starts at
    ``bottom`` unless a value lies at or below it; then below that value (linear: a 5%
    margin; log: the next labelled 1-2-5 tick under it), and ends with a margin above the
    highest: every value lies strictly inside, none is clipped."""
    lo, hi = min(values), max(values)
    if hi > LOG_ABOVE and lo > 0 and bottom > 0:
        return (bottom if lo > bottom else _tick_below(lo / 1.15)), hi * 1.15, True
    span = max(hi, bottom) - min(lo, bottom) or 1.0
    low = bottom if lo > bottom else lo - 0.05 * span
    return low, max(hi, bottom) + 0.05 * span, False


def _tick_below(v: float) -> float:
    """The largest 1-2-5 tick of the log axis at or below ``v > 0`` (a labelled bottom)."""
    decade = 10.0 ** math.floor(math.log10(v))
    return max(m * decade for m in (1.0, 2.0, 5.0) if m * decade <= v * (1 + 1e-12))


def _y_axis(ax: Any, values: Sequence[float], bottom: float = 0.9) -> None:
    """The ratio axis of the plotted ``values`` (every panel sharing it): limits from
    :func:`ratio_limits`; linear with 5-8 labelled ticks (``1x``, ``1.5x``, ...), or log
    with labelled 1-2-5 ticks."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    low, high, log = ratio_limits(values, bottom)
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=7, steps=[1, 2, 2.5, 5, 10]))
    ax.set_ylim(bottom=low, top=high)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.grid(True, alpha=0.3)


def _lines(ax: Any, rows: Sequence[dict[str, Any]], x: Any) -> None:
    for name, pts in _grouped(rows, "policy").items():
        pts = sorted(pts, key=x)
        line, marker = style(name)
        ys = [p["rel_ideal"] for p in pts]
        ax.plot([x(p) for p in pts], ys, linestyle=line, marker=marker, label=label(name))
    ax.axhline(1.0, color="black", linewidth=0.8)
    xs = sorted({x(p) for p in rows})
    ax.set_xticks(xs, [f"{v:g}" for v in xs])  # a labelled tick at every simulated point


def _panels(n: int) -> tuple[Any, list[Any]]:
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n + 1.6, 3.8), squeeze=False)
    return fig, list(axes[0])


def figure_vs_skew(rows: Sequence[dict[str, Any]], title: str = "") -> Any:
    """The figure of :func:`plot_vs_skew` (not saved)."""
    by_ep = _grouped(rows, "ranks")
    fig, axes = _panels(len(by_ep))
    x_label = "MaxVio target" if rows[0].get("maxvio_target") is not None else "lognormal sigma"
    for ax, (R, pts) in zip(axes, sorted(by_ep.items()), strict=True):
        _lines(ax, pts, _skew_x)
        ax.set(xlabel=x_label, title=f"{title} EP={R}".strip())
        _y_axis(ax, [r["rel_ideal"] for r in pts])  # each EP size its own range
    axes[0].set_ylabel(Y_LABEL)
    legend_outside(axes[-1])
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
        _y_axis(ax, [r["rel_ideal"] for r in pts])  # each skew its own range
    axes[0].set_ylabel(Y_LABEL)
    legend_outside(axes[-1])
    return fig


def figure_policies(rows: Sequence[dict[str, Any]], title: str = "") -> Any:
    """Bars: each policy's mean step time / ideal on a recorded trace (one EP size)."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(rows) + 1.5), 3.8))
    names = [label(r["policy"]) for r in rows]
    ax.bar(range(len(rows)), [r["rel_ideal"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
    EP = rows[0].get("ranks")
    ax.set(ylabel=Y_LABEL, title=f"{title} recorded trace, EP={EP}".strip())
    _y_axis(ax, [r["rel_ideal"] for r in rows], bottom=0.0)
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
