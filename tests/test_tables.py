"""``moonplan.tables.render``: plain-text rich tables (aligned, no colour codes) and Markdown."""

from __future__ import annotations

import pytest

from moonplan.tables import render


def test_text_table_aligns_numbers_right_and_text_left() -> None:
    text = render(["name", "records", "share"], [["a", "5", "1.5%"], ["longer", "1,234", "-"]])
    lines = text.splitlines()
    assert lines[0].split() == ["name", "records", "share"]
    assert set(lines[1]) <= {"─", " "}  # the rule under the header
    a, longer = lines[2], lines[3]
    assert a.startswith("a ") and longer.startswith("longer")  # text: left
    assert a.index("5") == longer.index("1,234") + len("1,234") - 1  # numbers: right
    assert "\x1b" not in text and text == text.rstrip() and all(s == s.rstrip() for s in lines)


def test_title_and_markdown() -> None:
    assert render(["x"], [["1"]], title="T").splitlines()[0].strip() == "T"
    md = render(["a", "b"], [["1", "x"]], markdown=True)
    assert md.splitlines() == ["| a | b |", "|---|---|", "| 1 | x |"]


def test_rows_must_match_the_header() -> None:
    with pytest.raises(ValueError, match="2 cells"):
        render(["a", "b"], [["1"]])
