"""``moonplan.checks``: the argument checks the config and the trace generators share."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moonplan.checks import check_int, check_range


def test_check_int_takes_python_and_numpy_integers() -> None:
    assert check_int("tokens", 0, 0) == 0
    got = check_int("ranks", np.int64(8), 1)
    assert got == 8 and type(got) is int


@pytest.mark.parametrize(
    ("value", "low", "words"),
    [
        (0, 1, "topk must be an integer >= 1, got 0"),
        (True, 0, "topk must be an integer >= 0, got True"),
        (2.0, 1, "topk must be an integer >= 1, got 2.0"),
        ("3", 1, "topk must be an integer >= 1, got '3'"),
        (None, 1, "topk must be an integer >= 1, got None"),
        (np.int32(-1), 0, "topk must be an integer >= 0"),
    ],
)
def test_check_int_names_the_argument_and_what_it_got(value: object, low: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        check_int("topk", value, low)


def test_check_range() -> None:
    assert check_range("rho", 1, -1.0, 1.0) == 1.0
    assert check_range("sigma", 3.5, 0.0, math.inf) == 3.5
    for bad in (-0.1, "0.5", None):
        with pytest.raises(ValueError, match=r"hot_share must be a number in \[0.0, 1.0\]"):
            check_range("hot_share", bad, 0.0, 1.0)  # type: ignore[arg-type]
