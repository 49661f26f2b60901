"""Scaffolding shared by the ``bench/bench_*.py`` scripts (run as ``python bench/<name>.py``)."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import string
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
"""Where every benchmark writes by default (``bench/results``, ignored by git), wherever it
is run from."""


def result_path(name: str) -> str:
    """The default output path of a benchmark's JSON report: ``name`` under :data:`RESULTS`."""
    return str(RESULTS / name)


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` shows the script's docstring ``doc`` as written."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def timing_parser(doc: str | None, *, reps: int, out: str) -> argparse.ArgumentParser:
    """:func:`bench_parser` with ``--quick``, ``--reps`` (default ``reps``) and ``--out``
    (default ``out``), the options of every timing benchmark."""
    ap = bench_parser(doc)
    ap.add_argument("--quick", action="store_true", help="small configurations only")
    ap.add_argument("--reps", type=int, default=reps, help=f"timed repetitions (default {reps})")
    ap.add_argument("--out", default=out, help="JSON output path")
    return ap


def time_interleaved(
    first: Callable[[], Any], second: Callable[[], Any], reps: int, warmup: int
) -> tuple[list[float], list[float]]:
    """Seconds of ``reps`` calls of ``first`` and of ``second``, alternating one call of
    each (``first`` first), after ``warmup`` untimed rounds: a busy machine slows both alike,
    so their ratio is steadier than two separate loops'."""
    first_s, second_s = [], []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        first()
        t1 = time.perf_counter()
        second()
        t2 = time.perf_counter()
        if i >= warmup:
            first_s.append(t1 - t0)
            second_s.append(t2 - t1)
    return first_s, second_s


def median_us(fn: Callable[[], Any], reps: int, cuda: bool, *, drain_after: bool = True) -> float:
    """Median microseconds of one call of ``fn`` over ``reps`` calls, after one warm-up call.

    With ``cuda`` the device is drained before each call and, when ``drain_after``, after it
    (the call's wall time, its kernels included); with ``drain_after=False`` the time is the
    host's alone (the call returns before the device finishes)."""
    import torch  # here: the other helpers of this module do not need it

    fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda and drain_after:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def median_ms(seconds: dict[str, list[float]]) -> dict[str, float]:
    """``{name + "_ms": median milliseconds}`` of each list of seconds."""
    return {f"{name}_ms": statistics.median(s) * 1e3 for name, s in seconds.items()}


class TextTable:
    """A fixed-width text table: a ``str.format`` template of one row and its titles.

    ``row`` holds one right-aligned field a column, ``{key:>width}`` or
    ``{key:>width.prec}`` (e.g. ``{grouped_ms:>10.2f}``), one space apart; ``titles``
    names the columns in order, ``|``-separated. :meth:`header` right-aligns each title
    to its column's width, so rows line up under it.
    """

    def __init__(self, row: str, titles: str) -> None:
        self.row_template = row
        self.titles = titles.split("|")
        specs = [spec for _, field, spec, _ in string.Formatter().parse(row) if field]
        self.widths = [int(re.findall(r"^>(\d+)", spec)[0]) for spec in specs]
        if len(self.widths) != len(self.titles):
            raise ValueError(f"{len(self.titles)} titles for {len(self.widths)} columns")

    def header(self) -> str:
        return " ".join(format(t, f">{w}") for t, w in zip(self.titles, self.widths, strict=True))

    def row(self, values: dict[str, Any], **more: Any) -> str:
        """One row from ``values`` and ``more`` (cells the row dict does not hold as such)."""
        return self.row_template.format(**values, **more)


def write_json(path: str, result: dict[str, Any]) -> Path:
    """Write ``result`` as indented JSON to ``path`` (creating its folder), say so, return it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return out


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    """A Markdown table of ``header`` and ``lines`` (one list of cells a row)."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])


def write_report(path: str, result: dict[str, Any], md: list[str]) -> Path:
    """Write ``result`` as JSON to ``path`` and ``md`` (Markdown lines) beside it as ``.md``;
    print the Markdown and where both went (with ``result["seconds"]`` when present)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=_plain) + "\n")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {out} and {out.with_suffix('.md')} in {result.get('seconds', 0):.0f} s")
    return out


def _plain(x: Any) -> Any:
    """JSON for what ``json`` cannot write: numbers as floats, the rest as strings."""
    return float(x) if hasattr(x, "__float__") else str(x)


def section(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """Run one section of a check script; store its result or its error (never raises)."""
    t0 = time.perf_counter()
    try:
        results[name] = {"ok": True, **fn()}
    except Exception as exc:
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        traceback.print_exc()
    results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    print(f"[{name}] {'ok' if results[name]['ok'] else 'FAILED'} ({results[name]['seconds']} s)")
    sys.stdout.flush()


def gated_sections(
    results: dict[str, Any],
    key: str,
    available: tuple[bool, str],
    what: str,
    sections: dict[str, Callable[[], Any]],
) -> None:
    """Run ``sections`` (name -> function, in order) with :func:`section` where ``available``
    (a backend's ``(ok, why)``) says ``what`` is there; else store ``results[key]`` as an ok
    skip that says why (a missing backend is not a failed check)."""
    ok, why = available
    if not ok:
        results[key] = {"ok": True, "skipped": f"{what} unavailable: {why}"}
        return
    for name, fn in sections.items():
        section(results, name, fn)
