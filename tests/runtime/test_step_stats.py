"""``StepStats`` (``runtime/step_stats.py``) prints as a small table with units."""

from __future__ import annotations

from moonplan.runtime.step_stats import StepStats


def test_prints_as_a_table_with_units() -> None:
    stats = StepStats(
        copies=3,
        new_copies=1,
        prefetched_rows=1,
        static_max_over_mean=1.5,
        planned_max_over_mean=1.0,
        phases={"counts": 0.00125, "plan": 0.002, "prefetch": 0.0004},
        predicted={"static": 0.004, "exact": 0.003},
        records=128,
        rows_sent=96,
        bytes_sent=4096,
    )
    lines = str(stats).splitlines()
    assert lines[0].split() == ["step", "figure", "value"]
    rows = {ln.split("  ")[0].strip(): ln.split("  ")[-1].strip() for ln in lines[2:]}
    assert rows["replica copies"] == "3 (1 new)"
    assert rows["load max/mean"] == "static EP 1.500 -> planned 1.000"
    assert rows["rows sent"] == "96 (0.750 per record)"
    assert rows["bytes sent"] == "4.0 KiB"
    assert rows["counts"] == "1.250 ms" and rows["prefetch (background)"] == "0.400 ms"
    assert rows["predicted step"] == "exact 3.000 ms, static 4.000 ms"  # fastest first
    assert len(lines) == 2 + 8 + 3 + 1
    assert repr(stats).startswith("StepStats(copies=3")  # repr keeps every field
