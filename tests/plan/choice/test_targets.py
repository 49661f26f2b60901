"""Capped water-filling and the level caps: the definition, and its torch twin equal to it."""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from moonplan.plan.choice.targets import (
    bounded_cap,
    level_caps,
    level_caps_torch,
    parse_bounded,
    water_fill,
    water_fill_torch,
)

loads = st.lists(
    st.one_of(st.integers(0, 5), st.integers(0, 10_000), st.just(2**40)), min_size=1, max_size=12
)


@given(loads, st.data())
@example([0], None)
@example([5, 0, 0, 0], None)
@example([2**40, 0, 0], None)
def test_water_fill_meets_its_definition(load: list[int], data: st.DataObject | None) -> None:
    R, N = len(load), sum(load)
    m = -(-N // R)
    cap = m if data is None else data.draw(st.integers(m, max(m, max(load)) + 3))
    t = water_fill(load, cap)
    assert sum(t) == N and max(t) <= cap  # conservation; the cap holds
    donors = [r for r in range(R) if load[r] > cap]
    assert all(t[r] == cap for r in donors)  # a donor sheds exactly to the cap
    assert all(t[r] >= load[r] for r in range(R) if r not in donors)  # nobody else loses
    if donors:  # every raised rank ends within one record of the lowest raised level
        raised = [t[r] for r in range(R) if r not in donors and t[r] > load[r]]
        kept = [t[r] for r in range(R) if r not in donors and t[r] == load[r]]
        if raised:
            assert max(raised) - min(raised) <= 1
            assert all(k >= max(raised) - 1 for k in kept)  # only the lowest loads were raised
    else:
        assert t == load


@given(loads, st.integers(1, 12))
def test_torch_twin_equals_the_definition(load: list[int], levels: int) -> None:
    caps = level_caps(load, levels)
    load_R = torch.tensor(load)
    assert level_caps_torch(load_R, levels).tolist() == caps
    m = -(-sum(load) // len(load))
    every = [*caps, m, max(load), max(load) + 1]
    got = water_fill_torch(load_R, torch.tensor(every)).tolist()
    assert got == [water_fill(load, c) for c in every]


@given(loads, st.integers(2, 12))
def test_levels_run_from_exact_to_static(load: list[int], levels: int) -> None:
    caps = level_caps(load, levels)
    m = -(-sum(load) // len(load))
    assert len(caps) == levels - 1 and caps == sorted(caps)
    assert all(m <= c <= max(m, max(load)) for c in caps)


def test_bounded_names_are_exact_decimals() -> None:
    assert parse_bounded("bounded-0.1") == parse_bounded("bounded-1/10")
    for bad in ("bounded-0.1 ", " bounded-0.1", "bounded--1", "bounded-x", "exact"):
        assert parse_bounded(bad) is None, bad
    eps = parse_bounded("bounded-0.25")
    assert eps is not None and bounded_cap(100, 8, eps) == 16  # ceil(12.5 * 1.25)
