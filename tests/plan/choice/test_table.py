"""The candidate table: fixed order and names, levels parsed exactly."""

from __future__ import annotations

import pytest

from moonplan.plan.choice.table import LEVELS, RESIDENT, names, parse_level, placed_index, table


def test_order_puts_static_then_exact_first() -> None:
    got = names(4)
    assert got == (
        "static", "exact", "resident", "level-3", "level-2", "level-1", "greedy", "placed"
    )  # fmt: skip
    assert len(table()) == LEVELS + 4
    assert [c.constructs for c in table(2)] == [False, True, False, True, True, False]
    assert names()[RESIDENT] == "resident" and names()[placed_index()] == "placed"


def test_levels_parse_exactly() -> None:
    assert parse_level("level-3") == 3 and parse_level(f"level-{LEVELS - 1}") == LEVELS - 1
    for bad in ("level-0", f"level-{LEVELS}", "level-03", "level-3 ", "level-x", "exact"):
        assert parse_level(bad) is None, bad
    with pytest.raises(ValueError):
        table(0)
