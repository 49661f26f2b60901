"""Two runs of ``bench_auto_sweep.py`` side by side: what a change of ``auto``'s rule did.

Legend: S tokens per rank (the grid's 16 ... 16384).

    python bench/compare_auto_sweeps.py BEFORE.json AFTER.json [--names before after]

Reads the JSON each run wrote (``--out``), pairs the points of the generated grid and of the
real traces by their keys, and prints, per tokens per rank: how many points are within 1.01x
the best peer and within 1.01x static EP, the worst auto / best peer, and the geometric mean
of after / before; then the points that moved the most either way. Writes
``bench/results/compare_auto_sweeps.json`` and ``.md``. Both runs must come from the same
grid (the script says which keys it could not pair).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, markdown_table, write_report

ROOT = Path(__file__).resolve().parents[1]
BAR = 1.01
KEY = ("model", "hardware", "ranks", "sigma", "tokens")
REAL_KEY = ("trace", "hardware")


def _index(rows: list[dict[str, Any]], key: tuple[str, ...]) -> dict[tuple[Any, ...], Any]:
    return {tuple(r[k] for k in key): r for r in rows}


def _gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _bucket(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[str]:
    """One column's cells: within the bars, worst, geometric mean after / before."""
    cells = []
    for side in (0, 1):
        rows = [p[side] for p in pairs]
        peers = sum(r["vs_peers"] <= BAR for r in rows)
        static = sum(r["vs_static"] <= BAR for r in rows)
        worst = max(r["vs_peers"] for r in rows)
        cells.append(f"{peers} / {static} of {len(rows)}, worst {worst:.2f}")
    ratio = _gmean([a["us"]["moonplan-auto"] / b["us"]["moonplan-auto"] for b, a in pairs])
    return [*cells, f"{ratio:.3f}"]


def by_tokens(pairs: list[tuple[dict[str, Any], dict[str, Any]]], names: list[str]) -> list[str]:
    """Markdown: per tokens per rank, each run's points within the bars and the ratio."""
    lines = []
    for s in sorted({b["tokens"] for b, _ in pairs}):
        at = [p for p in pairs if p[0]["tokens"] == s]
        lines.append([f"{s:.0f}", *_bucket(at)])
    lines.append(["all", *_bucket(pairs)])
    head = [
        "S",
        *(f"{n}: within 1.01x best peer / static" for n in names),
        "auto after / before",
    ]
    return [markdown_table(head, lines)]


def movers(pairs: list[tuple[dict[str, Any], dict[str, Any]]], most: int) -> list[str]:
    """Markdown: the points whose auto time changed most, both ways."""
    pairs = sorted(pairs, key=lambda p: p[1]["us"]["moonplan-auto"] / p[0]["us"]["moonplan-auto"])
    chosen = pairs[:most] + pairs[-most:]
    lines = []
    for b, a in chosen:
        where = f"{b['model']} {b['hardware']} EP{b['ranks']} σ{b['sigma']:g} S={b['tokens']:.0f}"
        ua, ub = a["us"]["moonplan-auto"], b["us"]["moonplan-auto"]
        lines.append([where, f"{ub:.0f}", f"{ua:.0f}", f"{ua / ub:.3f}",
                      f"{b['us']['static-linear']:.0f}", f"{a['vs_peers']:.3f}"])  # fmt: skip
    head = [
        "point",
        "auto µs before",
        "auto µs after",
        "after / before",
        "static µs",
        "after / best peer",
    ]
    return [markdown_table(head, lines)]


def pair(before: list[Any], after: list[Any], key: tuple[str, ...]) -> tuple[list[Any], int]:
    """Matched ``(before, after)`` rows and how many keys had no partner."""
    ib, ia = _index(before, key), _index(after, key)
    common = [k for k in ib if k in ia]
    return [(ib[k], ia[k]) for k in common], len(ib) + len(ia) - 2 * len(common)


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--names", nargs=2, default=["before", "after"])
    ap.add_argument("--most", type=int, default=8, help="points listed each way")
    ap.add_argument("--out", default=str(ROOT / "bench/results/compare_auto_sweeps.json"))
    args = ap.parse_args()
    b, a = (json.loads(Path(p).read_text()) for p in (args.before, args.after))
    grid, lost = pair(b["points"], a["points"], KEY)
    real, lost_real = pair(b.get("real", []), a.get("real", []), REAL_KEY)
    md = [f"### auto: {args.names[0]} ({args.before}) against {args.names[1]} ({args.after})", "",
          f"Generated grid: {len(grid)} points paired ({lost} unpaired).", "",
          *by_tokens(grid, args.names), "", *movers(grid, args.most), ""]  # fmt: skip
    if real:
        md += [f"Real traces: {len(real)} points paired ({lost_real} unpaired).", "",
               *by_tokens(real, args.names), ""]  # fmt: skip
    result = {"before": args.before, "after": args.after, "names": args.names,
              "pairs": [{"key": [b[k] for k in KEY], "before_us": b["us"]["moonplan-auto"],
                         "after_us": a["us"]["moonplan-auto"]} for b, a in grid]}  # fmt: skip
    write_report(args.out, result, md)


if __name__ == "__main__":
    main()
