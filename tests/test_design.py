"""docs/design.md names only paths that exist: its module map matches the tree.

Legend: none (text only).

Every code span of the page that reads as a path (it holds a ``/`` or ends in a file
suffix such as ``.py``) must exist. A path is read from the repository root, from
``moonplan/`` (``runtime/step_hooks.py`` is ``moonplan/runtime/step_hooks.py``), or from a
folder named before it in the same paragraph or list item (the module map's
``moonplan/runtime/``: ``store.py``, ...), the nearest first; a ``*`` is a glob, and a
span with a ``<placeholder>`` or a space is prose, not a path.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
SUFFIX = re.compile(r"\.(py|md|cu|cuh|json|toml|txt)$")


def blocks(page: str) -> list[str]:
    """The paragraphs and list items of ``page`` (a new one at a blank line or a bullet)."""
    out: list[list[str]] = [[]]
    for line in page.splitlines():
        if not line.strip() or re.match(r"\s*[*-] ", line):
            out.append([])
        out[-1].append(line)
    return [" ".join(b) for b in out if b]


def path_spans(text: str) -> list[str]:
    """The code spans of ``text`` that read as paths, in order."""
    spans = re.findall(r"`([^`\n]+)`", text)
    return [s for s in spans if ("/" in s or SUFFIX.search(s)) and not re.search(r"[<> ]", s)]


def resolve(path: str, folders: list[Path]) -> Path | None:
    """Where ``path`` is: under the nearest of ``folders`` (the block's, latest last),
    the root or ``moonplan/``; ``None`` where it is nowhere."""
    for base in [*reversed(folders), ROOT, ROOT / "moonplan"]:
        hits = sorted(base.glob(path.rstrip("/")))
        if hits:
            return hits[0]
    return None


def missing_paths(page: str) -> list[str]:
    """The paths ``page`` names that do not exist (each once)."""
    missing: list[str] = []
    for block in blocks(page):
        folders: list[Path] = []
        for span in path_spans(block):
            found = resolve(span, folders)
            if found is None:
                missing.append(span)
            elif found.is_dir():
                folders.append(found)
    return list(dict.fromkeys(missing))


def test_the_checker_reads_folders_before_their_files() -> None:
    page = (
        "* `moonplan/runtime/`: `store.py`, `config/` (`sections.py`), `transports/`.\n"
        "* `tests/<pkg>/t.py`, `plan(counts)` and `one two/` are prose.\n"
        "\n"
        "`store.py` alone, `cli/*_ranks.py`, `runtime/no_such_file.py`.\n"
    )
    assert path_spans("`a/b.py`, `x.md`, `plan(c)`, `t/<p>/t.py`") == ["a/b.py", "x.md"]
    assert missing_paths(page) == ["store.py", "runtime/no_such_file.py"]


def test_every_path_the_design_page_names_exists() -> None:
    page = DESIGN.read_text()
    assert len(path_spans(page)) > 60  # the module map is there
    missing = missing_paths(page)
    assert missing == [], f"docs/design.md names paths that do not exist: {missing}"
