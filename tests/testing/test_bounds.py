"""The least largest load the holders allow (``moonplan/testing/bounds.py``)."""

from __future__ import annotations

import itertools

from moonplan.testing.bounds import least_largest_load


def test_hand_cases() -> None:
    assert least_largest_load([10], [[0]], 2) == 10  # one holder takes all
    assert least_largest_load([10], [[0, 1]], 2) == 5  # two split evenly
    assert least_largest_load([11], [[0, 1]], 2) == 6  # whole records: the ceiling
    # expert 0 only on rank 0, expert 1 on both: rank 1 takes all of expert 1 first
    assert least_largest_load([6, 2], [[0], [0, 1]], 2) == 6
    assert least_largest_load([2, 6], [[0], [0, 1]], 2) == 4
    assert least_largest_load([0, 0], [[0], [1]], 2) == 0


def _brute(T: list[int], holders: list[list[int]], R: int) -> int:
    """Every way to split two experts' records over their holders (tiny cases)."""
    best = sum(T)
    splits = []
    for t, h in zip(T, holders, strict=True):
        parts = itertools.product(range(t + 1), repeat=len(h))
        splits.append([dict(zip(h, p, strict=True)) for p in parts if sum(p) == t])
    for choice in itertools.product(*splits):
        load = [sum(part.get(r, 0) for part in choice) for r in range(R)]
        best = min(best, max(load))
    return best


def test_equals_a_brute_force_on_small_cases() -> None:
    cases = [
        ([5, 3], [[0, 1], [1, 2]], 3),
        ([7, 1, 4], [[0], [1, 2], [0, 2]], 3),
        ([4, 4, 4], [[0, 1], [1, 2], [2, 0]], 3),
        ([9, 0, 2], [[0, 1, 2], [1], [2]], 3),
    ]
    for T, holders, R in cases:
        assert least_largest_load(T, holders, R) == _brute(T, holders, R), (T, holders)
