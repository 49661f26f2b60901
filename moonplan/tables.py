"""Text tables of every CLI and report, drawn by ``rich`` (plain text, no colour codes).

``render(header, rows)`` returns the table as a string, so the same text goes to a
terminal, a pipe or a CI log (and tests can read it). Numeric columns are right-aligned,
text columns left-aligned. ``markdown=True`` gives a GitHub Markdown table instead (what
the benchmarks write into ``docs/``).
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table

_NUMBER = re.compile(r"^[<>=~+-]*\s*[-+]?[\d.,]+(e[-+]?\d+)?\s*[%a-zA-Z/]*$|^-$|^$")


def _numeric(cells: Sequence[str]) -> bool:
    return all(_NUMBER.match(c.strip()) for c in cells) and any(c.strip() for c in cells)


def render(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    title: str | None = None,
    markdown: bool = False,
) -> str:
    """``rows`` of strings under ``header`` as a text (or Markdown) table.

    Args:
        header: column names.
        rows: one sequence of ``len(header)`` strings per line.
        title: a line above the table (text tables only).
        markdown: a GitHub Markdown table instead.

    Returns:
        The table, lines joined by ``"\\n"``, without trailing spaces or newline.
    """
    header = [str(h) for h in header]
    rows = [[str(c) for c in row] for row in rows]
    if any(len(r) != len(header) for r in rows):
        raise ValueError(f"every row needs {len(header)} cells")
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title=title)
    table.title_justify = "left"
    for i, name in enumerate(header):
        right = _numeric([r[i] for r in rows])
        table.add_column(name, justify="right" if right else "left", no_wrap=True)
    for r in rows:
        table.add_row(*r)
    buf = io.StringIO()
    console = Console(file=buf, width=4096, color_system=None, highlight=False, emoji=False)
    console.print(table)
    lines = [line.rstrip() for line in buf.getvalue().splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)
