"""Text and Markdown tables of simulator results (sweep rows, break-even, trends).

A sweep table has one line per (EP size, skew) and one column per policy, holding
the step time relative to the force-balanced ideal (``rel_ideal``); a detail table
lists every phase and metric of every row. Policy columns carry the label each
policy registered (``moonplan.baselines.registry``), the plots' legends the same.

A policy that drops records (capacity) does less work than the others, so its step time
is not comparable: its cells read ``(1.00) 38% dropped`` (the ratio in parentheses, the
share of records it dropped) and a note under the table says so (:data:`NOT_COMPARABLE`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from moonplan.baselines.registry import info
from moonplan.tables import render


def label(policy: str) -> str:
    """The column header of ``policy``: its registered label (``moonplan.baselines.registry``),
    or the name itself for a name nobody registered."""
    try:
        return info(policy).header(policy)
    except ValueError:
        return policy


def _policies(rows: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["policy"] for r in rows))


def _skew(r: dict[str, Any]) -> str:
    """``maxvio 1``, ``sigma 0.5``, or ``recorded`` for a recorded trace (no sigma)."""
    if r.get("maxvio_target") is not None:
        return f"maxvio {r['maxvio_target']:g}"
    sigma = r.get("sigma")
    if sigma is None or (isinstance(sigma, float) and math.isnan(sigma)):
        return "recorded"
    return f"sigma {sigma:g}"


NOT_COMPARABLE = (
    "(x.xx) n% dropped: not comparable in step time: the policy dropped n% of the records "
    "(capacity overflow), the others execute them all"
)
"""The note under a sweep table with a policy that drops records."""


def drops(rows: Sequence[dict[str, Any]]) -> set[str]:
    """Policies that dropped records in any of ``rows``."""
    return {r["policy"] for r in rows if r.get("dropped_fraction", 0.0) > 0}


def ratio_cell(r: dict[str, Any], dropping: bool) -> str:
    """A sweep-table cell: the step time / ideal, or, for a policy that drops records,
    ``(ratio) n% dropped``."""
    if not dropping:
        return f"{r['rel_ideal']:.2f}"
    return f"({r['rel_ideal']:.2f}) {r.get('dropped_fraction', 0.0):.0%} dropped"


def sweep_table(rows: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """Step time / force-balanced ideal, lines (EP, skew, measured expert MaxVio), one
    column per policy; the ideal's absolute time (us) last; a policy that drops records
    marked not comparable (module docstring)."""
    pols, dropping = _policies(rows), drops(rows)
    keys = list(dict.fromkeys((r["ranks"], _skew(r)) for r in rows))
    header = ["EP", "skew", "MaxVio", *[label(p) for p in pols], "ideal us"]
    lines = []
    for R, skew in keys:
        at = {r["policy"]: r for r in rows if (r["ranks"], _skew(r)) == (R, skew)}
        first = next(iter(at.values()))
        cells = [ratio_cell(at[p], p in dropping) if p in at else "-" for p in pols]
        lines.append(
            [str(R), skew, f"{first['expert_maxvio']:.2f}", *cells, f"{first['ideal_us']:,.0f}"]
        )
    table = render(header, lines, markdown=markdown)
    return f"{table}\n{NOT_COMPARABLE}" if dropping else table


PHASES = ("plan", "prefetch", "dispatch", "experts", "combine")
"""Phases of a detail row after the step total, in microseconds (keys ``<phase>_us``)."""

METRICS = (
    ("balancedness", "balanced", "{:.3f}"),
    ("copies", "copies", "{:.1f}"),
    ("new_copies", "new", "{:.1f}"),
    ("moved_mb", "moved MB", "{:.0f}"),
    ("dropped_fraction", "dropped", "{:.1%}"),
)
"""Metric columns of a detail row after the phases: key, header, format."""

DETAIL = (
    ("total_us", "step us", "{:.0f}"),
    ("rel_ideal", "/ideal", "{:.2f}"),
    *((f"{p}_us", p, "{:.0f}") for p in PHASES),
    *METRICS,
)
"""Every detail column (key, header, format), in table order."""


def detail_table(rows: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """Every row: EP, skew, policy, then the phases (us) and the metrics."""
    header = ["EP", "skew", "policy", *[h for _, h, _ in DETAIL]]
    lines = [
        [str(r["ranks"]), _skew(r), r["policy"], *[f.format(r[k]) for k, _, f in DETAIL]]
        for r in rows
    ]
    return render(header, lines, markdown=markdown)


def break_even_table(results: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """One line per break-even result: model, hardware, EP, sigma, break-even S per policy."""
    pols = list(dict.fromkeys(p for res in results for p in res["break_even"]))
    header = ["model", "hardware", "EP", "sigma", *[f"{label(p)} S*" for p in pols]]
    lines = []
    for res in results:
        cells = [_be(res["break_even"].get(p), res["tokens"]) for p in pols]
        lines.append(
            [res["model"], res["hardware"], str(res["ranks"]), f"{res['sigma']:g}", *cells]
        )
    return render(header, lines, markdown=markdown)


def _be(value: int | None, grid: Sequence[int]) -> str:
    if value is None:
        return f"> {max(grid)}"
    return f"<= {value}" if value == min(grid) else str(value)


def trend_table(
    rows: Sequence[dict[str, Any]], keys: Sequence[str], *, markdown: bool = False
) -> str:
    """Selected ``keys`` of trend rows; ``*_us`` columns in microseconds with thousands
    separators (``7,810``), other floats with 3 significant digits, never exponents."""
    lines = [[_num(r[k], k) for k in keys] for r in rows]
    header = [f"{k.removesuffix('_us')} us" if k.endswith("_us") else k for k in keys]
    return render(header, lines, markdown=markdown)


def _num(v: Any, key: str = "") -> str:
    if not isinstance(v, float):
        return str(v)
    if key.endswith("_us") or abs(v) >= 1000:
        return f"{v:,.0f}" if abs(v) >= 10 else f"{v:.2f}"
    if v == 0 or abs(v) >= 0.01:
        return f"{v:.3g}"
    return f"{v:.2e}"
