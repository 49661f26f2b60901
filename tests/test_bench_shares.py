"""``bench/bench_shares.py``: the weighted lookup's weights, reference against batched."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_shares as bench


@pytest.mark.parametrize("kind", ["packed", "random"])
def test_one_case_checks_the_two_forms_equal_and_times_both(kind: str) -> None:
    """A case asserts the two forms' weights equal (``measure``) and reports both times
    and the experts poured over (at most ``E``, at least one where tables replicate)."""
    row = bench.measure((16, 4, 2, 3, kind), reps=1)
    assert (row["experts"], row["ranks"], row["slots"], row["tables"]) == (16, 4, 2, 3)
    assert 1 <= row["poured"] <= 16 and row["ref_ms"] > 0 and row["fast_ms"] > 0


def test_the_tables_are_valid_slot_tables() -> None:
    """Random tables hold no rank's own home expert and no expert twice on a rank."""
    from moonplan.plan.residency.serving import check_slots
    from moonplan.testing.tables import random_slot_tables

    _, g = bench.window(16, 4)
    for s_RB in random_slot_tables(16, 4, 2, 5, g):
        check_slots(s_RB, 4, 16)
