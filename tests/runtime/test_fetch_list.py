"""``fetch_list``: one rank's copies read from a plan once, against the torch reference;
the same read's row offsets (``row_offsets``) against the plan's.

Legend: R ranks, E experts, B slots, M = ceil(E/R), N new slots, D direct rows.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moonplan
from moonplan.plan.home import home_map, home_start
from moonplan.runtime.fetch_list import (
    FetchList,
    HomeRows,
    fetch_list,
    fetch_list_reference,
    plan_rows,
    row_offsets,
)
from moonplan.testing import counts_and_options


@given(counts_and_options(), st.data())
def test_fetch_list_equals_the_reference(drawn, data) -> None:
    """Random and adversarial counts (hot experts, empty ranks, few or no slots: direct
    rows), with and without a previous plan (resident slots are not fetched again)."""
    counts_RE, options = drawn
    R, E = counts_RE.shape
    previous = moonplan.plan(counts_RE.roll(1, 1), **options)
    use_previous = data.draw(st.booleans(), label="previous")
    p = moonplan.plan(counts_RE, previous=previous if use_previous else None, **options)
    home = HomeRows.of(E, R)
    rows = plan_rows(p)
    assert rows[:, -1].tolist() == p.recv_size().tolist()
    for rank in range(R):
        got = fetch_list(p, rank, home)
        assert got == fetch_list_reference(p, rank) == fetch_list(p, rank, home, rows)
        assert row_offsets(p, rank, rows) == tuple(p.row_offset[rank].tolist())
        assert len(got.slot_N) == int((p.slot_new[rank] > 0).sum())
        assert len(got.direct_rank_D) == int((p.direct_expert()[rank] >= 0).sum())


def test_home_rows_match_the_home_map() -> None:
    for E, R in [(1, 1), (8, 2), (7, 3), (3, 5), (64, 8)]:
        home = HomeRows.of(E, R)
        assert list(home.rank_E) == home_map(E, R).tolist()
        for e, (h, row) in enumerate(zip(home.rank_E, home.row_E, strict=True)):
            assert home_start(h, E, R) + row == e
            assert 0 <= row < -(-E // R)


def _counts_hot(R: int, E: int) -> torch.Tensor:
    c = torch.zeros(R, E, dtype=torch.int64)
    c[:, 0] = 40  # expert 0 (rank 0's) carries everything: replicas elsewhere
    return c


def test_static_and_resident_plans_fetch_nothing() -> None:
    c = _counts_hot(2, 4)
    home = HomeRows.of(4, 2)
    static = moonplan.plan(c, policy="static")
    assert fetch_list(static, 0, home) == FetchList((), (), (), (), (), False)
    first = moonplan.plan(c, slots=2)
    again = moonplan.plan(c, slots=2, previous=first)  # the same replicas stay resident
    got = [fetch_list(first, r, home) for r in range(2)]
    assert got[1].mine and got[1].slot_N and got[1].slot_rank_N == (0,) * len(got[1].slot_N)
    assert not got[0].mine and got[0].group  # rank 0 copies nothing, rank 1 does
    assert not any(fetch_list(again, r, home).group for r in range(2))


def test_index_orders_slot_sources_before_direct_sources() -> None:
    f = FetchList((1, 3), (0, 2), (5, 6), (1,), (4,), True)
    slot_N, rank_C, row_C = f.index(torch.device("cpu"))
    assert slot_N.tolist() == [1, 3] and slot_N.dtype == torch.int64
    assert rank_C.tolist() == [0, 2, 1] and row_C.tolist() == [5, 6, 4]
    empty = FetchList((), (), (), (), (), False).index(torch.device("cpu"))
    assert [t.shape for t in empty] == [torch.Size([0])] * 3


@pytest.mark.gpu
def test_index_on_cuda_equals_the_host_index() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    f = FetchList((0, 2), (1, 1), (3, 0), (2,), (1,), True)
    got = f.index(torch.device("cuda"))
    for g, want in zip(got, f.index(torch.device("cpu")), strict=True):
        assert g.is_cuda and torch.equal(g.cpu(), want)
