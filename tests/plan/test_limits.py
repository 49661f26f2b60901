"""Planner limits: totals beyond int64, slots beyond E, align beyond what the records can
use are PlanErrors naming the limit; everything inside the limits plans and checks."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moonplan
from moonplan import PlanError, check_plan
from moonplan.plan.static import static_plan
from moonplan.plan.validate import ALIGN_FREE, INT64_MAX

BACKENDS = ["reference", "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "counts",
    [
        np.full((4, 8), 2**62, dtype=np.int64),  # wraps to 0 in int64
        [[2**62, 2**62]],  # exactly 2**63
        [[INT64_MAX, 1], [0, 0]],
    ],
)
def test_totals_beyond_int64_are_refused(counts, backend):
    with pytest.raises(PlanError, match=r"beyond the int64 limit 2\*\*63 - 1"):
        moonplan.plan(counts, backend=backend)
    with pytest.raises(PlanError, match="int64 limit"):
        static_plan(counts)


@given(
    st.integers(1, 4),
    st.integers(1, 6),
    st.lists(st.integers(0, 2**62), min_size=24, max_size=24),
    st.sampled_from(BACKENDS),
)
def test_huge_counts_plan_exactly_or_raise(R, E, values, backend):
    counts_RE = torch.tensor(values[: R * E], dtype=torch.int64).view(R, E)
    total = sum(values[: R * E])
    if total > INT64_MAX:
        with pytest.raises(PlanError, match="int64 limit"):
            moonplan.plan(counts_RE, backend=backend)
        return
    p = moonplan.plan(counts_RE, backend=backend)
    check_plan(p, counts_RE)
    assert sum(p.alloc.sum(0).tolist()) == total


@pytest.mark.parametrize("slots", [5, 10**8, 10**9, 2**62])
def test_slots_beyond_E_are_refused_at_once(slots):
    t0 = time.perf_counter()
    with pytest.raises(PlanError, match=r"slots=\d+ exceeds the limit E = 4"):
        moonplan.plan([[1, 2, 3, 4], [4, 3, 2, 1]], slots=slots)
    assert time.perf_counter() - t0 < 1.0
    assert moonplan.plan([[1, 2, 3, 4], [4, 3, 2, 1]], slots=4).num_slots == 4  # E itself is fine


def test_default_slots_is_within_the_limit_for_every_shape():
    for R in range(1, 6):
        for E in range(1, 9):
            p = moonplan.plan(torch.ones(R, E, dtype=torch.int64))  # slots=None: ceil(E/R)
            assert p.num_slots == -(-E // R) <= E


@pytest.mark.parametrize("backend", BACKENDS)
def test_align_limits(backend):
    small = [[1, 2, 3, 4], [4, 3, 2, 1]]  # N = 20
    for align in (2**62, ALIGN_FREE + 1):
        with pytest.raises(PlanError, match=r"exceeds the limit max\(65536, N rounded up"):
            moonplan.plan(small, align=align, backend=backend)
    check_plan(moonplan.plan(small, align=ALIGN_FREE, backend=backend), small)
    zeros = [[0, 0], [0, 0]]  # a step without tokens keeps any ordinary align
    assert moonplan.plan(zeros, align=128, backend=backend).recv_size().tolist() == [0, 0]
    big = [[2**40, 0], [0, 3]]  # N rounded up to 2**41: align up to there is allowed
    check_plan(moonplan.plan(big, align=2**41, backend=backend), big)
    with pytest.raises(PlanError, match="limit"):
        moonplan.plan(big, align=2**41 + 1, backend=backend)
    near = [[INT64_MAX - 10, 0], [0, 1]]  # 4 rows of padding at most: still fits
    check_plan(moonplan.plan(near, align=2, backend=backend), near)
    nearer = [[INT64_MAX - 2, 0], [0, 1]]
    with pytest.raises(PlanError, match=r"overflow int64"):
        moonplan.plan(nearer, align=2, backend=backend)


def test_padded_rows_never_wrap():
    counts = [[2**40, 7, 0], [0, 5, 2**39]]
    p = moonplan.plan(counts, align=2**20)
    check_plan(p, counts)
    assert bool((p.row_offset >= 0).all())
    assert int(p.recv_size().max()) >= 2**40 // 2
