"""PNG plots of policies and simulated step times (matplotlib, imported only when plotting).

Install the optional dependency with ``pip install matplotlib`` (or the ``plot``
extra). Every function writes one PNG to ``path`` and returns the path.

* :func:`plot_rank_loads`: records per rank of each policy on one step;
* :func:`plot_balancedness`: balancedness (mean/max) of each policy over steps;
* :func:`plot_vs_skew`, :func:`plot_vs_ep`: step time / force-balanced ideal
  against skew (one panel per EP size) or against EP size (one panel per skew);
  :func:`plot_sweep` picks between them from the rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from moonplan.baselines.policies import PolicyStep

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


STYLE: Mapping[str, tuple[str, str]] = MappingProxyType(
    {"moonep-greedy": ("--", "s"), "moonplan": ("-", "o"), "moonplan-resident": ("-", "D")}
)
"""Line style and marker per policy (others: solid with dots); the greedy is dashed because
it often coincides with moonplan."""


def _lines(ax: Any, rows: Sequence[dict[str, Any]], x: Any) -> None:
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for name, pts in _grouped(rows, "policy").items():
        pts = sorted(pts, key=x)
        style, marker = STYLE.get(name, ("-", "."))
        ys = [p["rel_ideal"] for p in pts]
        ax.plot([x(p) for p in pts], ys, linestyle=style, marker=marker, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="both", alpha=0.3)


def _panels(n: int) -> tuple[Any, list[Any]]:
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.8), squeeze=False, sharey=True)
    return fig, list(axes[0])


def plot_vs_skew(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Step time / ideal against skew (sigma, or the MaxVio target); a panel per EP size."""
    by_ep = _grouped(rows, "ranks")
    fig, axes = _panels(len(by_ep))
    label = "MaxVio target" if rows[0].get("maxvio_target") is not None else "lognormal sigma"
    for ax, (R, pts) in zip(axes, sorted(by_ep.items()), strict=True):
        _lines(ax, pts, _skew_x)
        ax.set(xlabel=label, title=f"{title} EP={R}".strip())
    axes[0].set_ylabel("step time / force-balanced ideal")
    axes[-1].legend(fontsize=7)
    return _save(fig, path)


def plot_vs_ep(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Step time / ideal against EP size (log2 axis); a panel per skew."""
    by_skew = _grouped([{**r, "_skew": _skew_x(r)} for r in rows], "_skew")
    fig, axes = _panels(len(by_skew))
    name = "MaxVio" if rows[0].get("maxvio_target") is not None else "sigma"
    for ax, (skew, pts) in zip(axes, sorted(by_skew.items()), strict=True):
        _lines(ax, pts, lambda p: p["ranks"])
        ax.set_xscale("log", base=2)
        ax.set(xlabel="EP size", title=f"{title} {name} {skew:g}".strip())
    axes[0].set_ylabel("step time / force-balanced ideal")
    axes[-1].legend(fontsize=7)
    return _save(fig, path)


def plot_sweep(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """:func:`plot_vs_skew` when the rows hold several skews, else :func:`plot_vs_ep`."""
    if not rows:
        raise ValueError("nothing to plot: no rows")
    skews = {_skew_x(r) for r in rows}
    return plot_vs_skew(rows, path, title) if len(skews) > 1 else plot_vs_ep(rows, path, title)
