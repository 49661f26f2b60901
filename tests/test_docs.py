"""The docs read in short lines and agree on what has run.

Legend: none (text only).

* No line of ``README.md``, ``CONTRIBUTING.md`` or ``docs/*.md`` is longer than 200
  characters; a table row may be longer, as long as each cell stays under 300.
* ``docs/status.md`` is the one page that says what has not run or been measured yet;
  every other page points there instead. So a status can only be wrong in one place.
* ``docs/status.md`` keeps in step with ``docs/benchmarks.md``: every date it cites is
  the date of a recorded session there, and it cites the latest GPU session. A new GPU
  session in the benchmarks therefore fails this test until the status page says what
  that session ran.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
STATUS = ROOT / "docs" / "status.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"

# Pages being rewritten by their owners, skipped for now: remove an entry once its page
# passes (test_a_skipped_page_still_needs_its_skip says when). simulator: the honest
# peers; gpu_planner: the CUDA planner page; reliability: issue 24.
SKIP_FOR_NOW: set[str] = set()
CHECKED = [p for p in PAGES if str(p.relative_to(ROOT)) not in SKIP_FOR_NOW]

NOT_RUN = re.compile(
    r"\bnot (yet )?(been )?(run|measured|calibrated)\b"
    r"|\b(run|measured|calibrated) yet\b"
    r"|\b(still )?unrun\b"
    r"|\bnever (been )?run\b",
    re.IGNORECASE,
)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row (``\\|`` inside a cell is not a separator)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def long_lines(text: str) -> list[str]:
    """``"line N: why"`` for each line over the limits (see the module docstring)."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("|"):
            worst = max((len(c) for c in _cells(line)), default=0)
            if worst >= 300:
                out.append(f"line {i}: a table cell of {worst} characters")
        elif len(line) > 200:
            out.append(f"line {i}: {len(line)} characters")
    return out


@pytest.mark.parametrize("page", CHECKED, ids=_name)
def test_no_line_over_200_characters(page: Path) -> None:
    assert long_lines(page.read_text(encoding="utf-8")) == []


def test_the_limits_are_what_they_say() -> None:
    cell = "x" * 299
    assert long_lines(f"{'y' * 200}\n| {cell} | b |\n| a \\| b | c |") == []
    assert long_lines("y" * 201) == ["line 1: 201 characters"]
    assert long_lines(f"| {'x' * 300} | b |") == ["line 1: a table cell of 300 characters"]


@pytest.mark.parametrize("page", [p for p in CHECKED if p not in (STATUS, BENCHMARKS)], ids=_name)
def test_only_the_status_page_says_what_has_not_run(page: Path) -> None:
    """Other pages link to ``docs/status.md``; ``docs/benchmarks.md`` records what was
    measured and how, so it may say what a session left out."""
    found = [
        f"line {i}: {m.group(0)!r}"
        for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if (m := NOT_RUN.search(line))
    ]
    assert found == [], "say it in docs/status.md and link there"


def test_the_pattern_finds_the_usual_phrasings() -> None:
    for text in ("not yet run on a GPU", "is not measured yet", "Not yet measured", "unrun"):
        assert NOT_RUN.search(text), text
    for text in ("runs on a GPU", "measured on 2026-11-30", "a rerun", "not runnable"):
        assert not NOT_RUN.search(text), text


def _session_dates() -> tuple[set[str], set[str]]:
    """Dates of every heading of ``docs/benchmarks.md``, and of its GPU sessions."""
    headings = [ln for ln in BENCHMARKS.read_text().splitlines() if ln.startswith("#")]
    every = {d for h in headings for d in DATE.findall(h)}
    gpu = {d for h in headings if "GPU" in h for d in DATE.findall(h)}
    return every, gpu


def test_status_cites_recorded_sessions_only() -> None:
    every, _ = _session_dates()
    cited = set(DATE.findall(STATUS.read_text()))
    assert cited, "docs/status.md cites no session"
    assert cited <= every, f"dates with no session in docs/benchmarks.md: {cited - every}"


def test_status_cites_the_latest_gpu_session() -> None:
    _, gpu = _session_dates()
    assert gpu, "docs/benchmarks.md records no GPU session"
    assert max(gpu) in STATUS.read_text(), f"docs/status.md does not cite the {max(gpu)} session"


def _problems(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    found = long_lines(text)
    if page not in (STATUS, BENCHMARKS):
        found += [f"line {i}" for i, ln in enumerate(text.splitlines(), 1) if NOT_RUN.search(ln)]
    return found


def test_a_skipped_page_still_needs_its_skip() -> None:
    """Keeps ``SKIP_FOR_NOW`` honest (empty today): once a page passes, its entry must go."""
    for name in sorted(SKIP_FOR_NOW):
        page = ROOT / name
        assert page.exists(), f"{name} is gone: remove it from SKIP_FOR_NOW"
        assert _problems(page), f"{name} passes now: remove it from SKIP_FOR_NOW"
