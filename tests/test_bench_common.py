"""``bench/_common.py``: the timing loops, medians, the fixed-width tables of the benchmarks and
the gated sections of the GPU checks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _common
from _common import (
    TextTable,
    gated_sections,
    markdown_table,
    median_ms,
    median_us,
    time_interleaved,
    timing_parser,
)


def test_text_table_lines_up_as_the_hand_written_format() -> None:
    t = TextTable("{a:>4} {name:>6} {x:>8.2f} {y:>6.1e}", "a|the name|x ms|y")
    assert t.widths == [4, 6, 8, 6]
    row = {"a": 3, "name": "ab", "x": 1.234, "y": 0.00012}
    assert t.header() == f"{'a':>4} {'the name':>6} {'x ms':>8} {'y':>6}"
    assert t.row(row) == f"{3:>4} {'ab':>6} {1.234:>8.2f} {0.00012:>6.1e}"
    assert t.row({"a": 1, "name": "n", "y": 1.0}, x=2.0).split()[2] == "2.00"


def test_markdown_table_has_a_rule_and_one_row_a_line() -> None:
    got = markdown_table(["S", "n"], [["16", "3"], ["64", "4"]])
    assert got == "| S | n |\n|---|---|\n| 16 | 3 |\n| 64 | 4 |"
    assert markdown_table(["a"], []) == "| a |\n|---|"


def test_text_table_needs_one_title_per_column() -> None:
    with pytest.raises(ValueError, match="2 titles for 3 columns"):
        TextTable("{a:>3} {b:>3} {c:>3}", "a|b")


def test_time_interleaved_alternates_and_skips_warmup() -> None:
    calls: list[str] = []
    first_s, second_s = time_interleaved(
        lambda: calls.append("a"), lambda: calls.append("b"), reps=3, warmup=2
    )
    assert calls == ["a", "b"] * 5
    assert len(first_s) == len(second_s) == 3 and min(first_s + second_s) >= 0


def test_median_ms_and_timing_parser() -> None:
    assert median_ms({"plan": [0.001, 0.003, 0.002], "sort": [0.5]}) == {
        "plan_ms": 2.0,
        "sort_ms": 500.0,
    }
    args = timing_parser("doc", reps=7, out="x.json").parse_args(["--quick"])
    assert (args.quick, args.reps, args.out) == (True, 7, "x.json")


def test_median_us_warms_up_once_then_takes_the_median(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    seconds = iter([9.0, 3e-6, 1e-6, 2e-6])  # the warm-up call, then three timed calls

    def fn() -> None:
        clock[0] += next(seconds)

    monkeypatch.setattr(_common.time, "perf_counter", lambda: clock[0])
    assert median_us(fn, 3, cuda=False) == pytest.approx(2.0)
    with pytest.raises(StopIteration):  # exactly 1 + reps calls were made
        fn()


def test_gated_sections_run_in_order_or_say_why_they_were_skipped() -> None:
    ran: list[str] = []

    def first() -> dict:
        ran.append("a")
        return {"x": 1}

    def failing() -> dict:
        ran.append("b")
        raise RuntimeError("boom")

    sections = {"a": first, "b": failing}
    results: dict = {}
    gated_sections(results, "kernel", (False, "no nvcc"), "cuda planner", sections)
    assert results == {"kernel": {"ok": True, "skipped": "cuda planner unavailable: no nvcc"}}
    assert ran == []
    results = {}
    gated_sections(results, "kernel", (True, ""), "cuda planner", sections)
    assert ran == ["a", "b"] and "kernel" not in results
    assert results["a"]["ok"] and results["a"]["x"] == 1
    assert not results["b"]["ok"] and results["b"]["error"] == "RuntimeError: boom"


def test_result_paths_do_not_depend_on_where_a_benchmark_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Run from inside ``bench/`` or anywhere, a report goes to the repository's
    ``bench/results`` (a relative default once wrote ``bench/bench/results``)."""
    monkeypatch.chdir(tmp_path)
    path = Path(_common.result_path("x.json"))
    assert path == Path(__file__).resolve().parents[1] / "bench" / "results" / "x.json"


def test_every_benchmark_default_output_is_a_result_path() -> None:
    """No benchmark names its default output relative to the working directory."""
    bench = Path(__file__).resolve().parents[1] / "bench"
    for script in sorted(bench.glob("*.py")):
        text = script.read_text()
        assert '"bench/results/' not in text.replace('ROOT / "bench/results/', ""), script.name
