"""The fast step-cost forms equal their readable references to the last bit.

``moonplan.stepcost.reference`` follows the definitions one quantity at a time;
``StepCost.step_time``, ``experts_R``, ``dispatch_traffic`` and ``pair_traffic`` compute
the same in fewer passes. Random allocations (hypothesis) and adversarial ones: empty
ranks, everything fetched, one hot expert, tiles larger than any row, huge counts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moonplan.stepcost import StepCost, get_hardware
from moonplan.stepcost.reference import (
    dispatch_traffic_reference,
    experts_R_reference,
    pair_traffic_reference,
    step_time_reference,
)
from moonplan.stepcost.traffic import dispatch_traffic, pair_traffic

FIELDS = ("local_R", "send_intra_R", "send_inter_R", "recv_intra_R", "recv_inter_R")
BASE = StepCost.from_hardware(get_hardware("h200-node"), "deepseek-v3")


def random_case(
    seed: int, R: int, E: int, scale: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(rows_ER, sent_RE, fetch_ER, src_E)``: random counts, each expert's records split
    over random ranks, random fetched pairs among those with rows."""
    g = np.random.default_rng(seed)
    sent_RE = g.integers(0, scale + 1, size=(R, E)) * (g.random((R, E)) < 0.7)
    T_E = sent_RE.sum(0)
    rows_ER = np.zeros((E, R), dtype=np.int64)
    for e in range(E):
        cuts = np.sort(g.integers(0, T_E[e] + 1, size=R - 1))
        rows_ER[e] = np.diff(np.concatenate([[0], cuts, [T_E[e]]]))
    fetch_ER = (g.random((E, R)) < 0.2) & (rows_ER > 0)
    src_E = g.integers(0, R, size=E)
    return rows_ER, sent_RE.astype(np.int64), fetch_ER, src_E


def costs(tile: int, domain: int) -> list[StepCost]:
    return [BASE.scaled(tile_rows=tile, domain=domain, overlap=o) for o in (True, False)]


def assert_traffic_equal(a: object, b: object) -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == np.int64 and np.array_equal(x, y), f


@given(
    seed=st.integers(0, 2**31),
    R=st.integers(1, 12),
    E=st.integers(1, 20),
    scale=st.sampled_from([0, 1, 5, 1000]),
    tile=st.sampled_from([1, 3, 64]),
    domain=st.integers(0, 5),
)
def test_step_time_equals_reference(
    seed: int, R: int, E: int, scale: int, tile: int, domain: int
) -> None:
    rows, sent, fetch, src = random_case(seed, R, E, scale)
    for cost in costs(tile, domain):
        got = cost.step_time(rows, sent, fetch, src, planned=2)
        want = step_time_reference(cost, rows, sent, fetch, src, planned=2)
        assert dataclasses.astuple(got) == dataclasses.astuple(want)
        assert np.array_equal(cost.experts_R(rows), experts_R_reference(cost, rows))
        G = cost.domain_size(R)
        assert_traffic_equal(
            dispatch_traffic(sent, rows, G), dispatch_traffic_reference(sent, rows, G)
        )
        pairs = np.stack([src[fetch.nonzero()[0]], fetch.nonzero()[1]], 1)
        assert_traffic_equal(pair_traffic(pairs, R, G), pair_traffic_reference(pairs, R, G))


@pytest.mark.parametrize(
    "name", ["empty", "all_fetched", "one_hot", "huge", "one_rank", "ragged_domain"]
)
def test_step_time_adversarial(name: str) -> None:
    R, E = (1, 4) if name == "one_rank" else (7, 9)
    rows, sent, fetch, src = random_case(3, R, E, 50)
    if name == "empty":
        rows, sent = rows * 0, sent * 0
    elif name == "all_fetched":
        fetch = rows > 0
    elif name == "one_hot":
        sent = np.zeros_like(sent)
        sent[:, 0] = 1_000_000
        rows = np.zeros_like(rows)
        rows[0] = sent[:, 0].sum() // R
        rows[0, 0] += sent[:, 0].sum() - rows[0].sum()
        fetch = rows > 0
    elif name == "huge":
        rows, sent = rows * 2**30, sent * 2**30
    for cost in costs(128, 3) + costs(1, 0):
        for args in (
            (rows, sent, fetch, src),
            tuple(torch.from_numpy(a) for a in (rows, sent, fetch, src)),
        ):
            got = cost.step_time(*args)
            want = step_time_reference(cost, *args)
            assert dataclasses.astuple(got) == dataclasses.astuple(want), name


def test_dispatch_traffic_rejects_unequal_totals() -> None:
    with pytest.raises(ValueError, match="equal expert totals"):
        dispatch_traffic(np.ones((2, 3), dtype=np.int64), np.ones((3, 2), dtype=np.int64) * 2, 1)
    with pytest.raises(ValueError, match="equal expert totals"):
        dispatch_traffic(np.ones((2, 3), dtype=np.int64), np.ones((2, 3), dtype=np.int64), 1)
