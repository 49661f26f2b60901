"""Static placement (``moonplan/plan/placement.py``) against a plain-Python definition."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moonplan
from moonplan.plan.home import home_list
from moonplan.plan.placement import (
    PLACEMENTS,
    placement_home,
    round_robin_home,
    static_alloc,
    static_load,
)
from moonplan.plan.static import static_plan
from moonplan.testing import counts


def reference_alloc(counts_RE: torch.Tensor, home: list[int]) -> list[list[int]]:
    """``alloc[e][r]``: every record of expert ``e`` on ``home[e]`` (the definition)."""
    R, E = counts_RE.shape
    rows = counts_RE.tolist()
    alloc = [[0] * R for _ in range(E)]
    for e in range(E):
        alloc[e][home[e]] = sum(rows[s][e] for s in range(R))
    return alloc


def reference_home(E: int, R: int, placement: str) -> list[int]:
    return home_list(E, R) if placement == "linear" else [e % R for e in range(E)]


@given(counts(), st.sampled_from(PLACEMENTS))
def test_static_alloc_and_load_match_the_definition(c: torch.Tensor, placement: str) -> None:
    R, E = c.shape
    home = reference_home(E, R, placement)
    home_E = placement_home(E, R, placement)
    assert home_E.tolist() == home
    want = reference_alloc(c, home)
    assert static_alloc(c, home_E).tolist() == want
    assert static_load(c, home_E).tolist() == [sum(a[r] for a in want) for r in range(R)]
    if placement == "linear":  # the default placement, and the plans built on it
        assert static_alloc(c).tolist() == want
        assert torch.equal(static_load(c), static_load(c, home_E))
        assert torch.equal(moonplan.plan(c).static_load(), static_load(c))
        assert static_plan(c).alloc.tolist() == want


def test_round_robin_by_hand_and_bad_input() -> None:
    assert round_robin_home(4, 2).tolist() == [0, 1, 0, 1]
    assert placement_home(5, 2, "linear").tolist() == [0, 0, 0, 1, 1]
    c = torch.tensor([[5, 1, 3, 0], [1, 1, 1, 1]])
    assert static_load(c, round_robin_home(4, 2)).tolist() == [10, 3]
    with pytest.raises(ValueError, match="placement"):
        placement_home(4, 2, "random")
    with pytest.raises(ValueError, match="ranks"):
        round_robin_home(4, 0)
    with pytest.raises(ValueError, match="home_E"):
        static_alloc(c, torch.tensor([0, 1, 2, 0]))  # rank 2 of 2
    with pytest.raises(ValueError, match="home_E"):
        static_load(c, torch.tensor([0, 1]))  # 2 of 4 experts
