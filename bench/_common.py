"""Scaffolding shared by the ``bench/bench_*.py`` scripts (run as ``python bench/<name>.py``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` shows the script's docstring ``doc`` as written."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def write_json(path: str, result: dict[str, Any]) -> Path:
    """Write ``result`` as indented JSON to ``path`` (creating its folder), say so, return it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return out


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
