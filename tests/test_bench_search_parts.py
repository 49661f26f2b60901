"""``bench/bench_search_parts.py``: its side-by-side run of two checkouts (here the same
one twice), its result fingerprints and its table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_search_parts import PARTS, digest, run, table_lines  # noqa: E402  (bench/ on the path)


@pytest.mark.slow  # the bench run twice side by side (3.5-18 s)
def test_one_checkout_against_itself_gives_the_same_results_and_a_table() -> None:
    rows = run([(4, 16)], reps=3, compare=ROOT)
    (row,) = rows
    assert row["same"] and row["differ"] == []
    for part in PARTS:
        assert row[f"{part}_us"] > 0 and row[f"{part}_old_us"] > 0
        assert row[f"{part}_ratio"] == row[f"{part}_old_us"] / row[f"{part}_us"]
    lines = table_lines(rows, compare=True)
    assert lines[0].count("|") == len(PARTS) + 4 and lines[-1].endswith("| yes |")


def test_digest_tells_results_apart() -> None:
    import torch

    assert digest(0.1 + 0.2) != digest(0.3)  # floats by their exact repr
    assert digest(torch.tensor([1, 2])) == digest(torch.tensor([1, 2]))
    assert digest(torch.tensor([1, 2])) != digest(torch.tensor([1, 2], dtype=torch.int32))


def test_unpack_gives_a_commits_tree(tmp_path: Path) -> None:
    from bench_search_parts import unpack

    tree = unpack("HEAD", tmp_path)
    assert (tree / "moonplan" / "stepcost" / "traffic.py").is_file()
    assert tree.parent == tmp_path
