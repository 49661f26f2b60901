"""Scaffolding shared by the ``bench/bench_*.py`` scripts (run as ``python bench/<name>.py``)."""

from __future__ import annotations

import argparse
import json
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
