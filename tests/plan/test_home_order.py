"""popular_order: a permutation in the linear map's block sizes, greedy largest-first,
within the heaviest expert of the mean, near the exhaustive optimum on small inputs."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonplan.errors import PlanError
from moonplan.plan.home import home_edges
from moonplan.plan.home_order import check_order, label_of, popular_order


def _rank_loads(order: list[int], load: list[float], R: int) -> list[float]:
    edges = home_edges(len(order), R)
    return [sum(load[e] for e in order[edges[r] : edges[r + 1]]) for r in range(R)]


_loads = st.one_of(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),  # many ties
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=40),
    st.lists(st.sampled_from([0.0, 1.0, 1e9]), min_size=1, max_size=40),  # one giant
)


@settings(max_examples=300, deadline=None)
@given(load=_loads, R=st.integers(1, 9))
def test_a_permutation_within_the_heaviest_expert_of_the_mean(load, R):
    order = popular_order(torch.tensor(load, dtype=torch.float64), R)
    assert sorted(order) == list(range(len(load)))
    edges = home_edges(len(load), R)
    for r in range(R):  # each block ascending: a deterministic, readable order
        assert order[edges[r] : edges[r + 1]] == sorted(order[edges[r] : edges[r + 1]])
    busiest = max(_rank_loads(order, load, R))
    assert busiest <= sum(load) / R + max(load) + 1e-6 * max(1.0, sum(load))


@settings(max_examples=150, deadline=None)
@given(load=st.lists(st.integers(0, 20), min_size=1, max_size=7), R=st.integers(1, 4))
def test_near_the_exhaustive_optimum_on_small_inputs(load, R):
    """Greedy against every assignment in the block sizes (measured worst: 1.5x, on
    three experts over a block of two and a block of one)."""
    busiest = max(_rank_loads(popular_order(torch.tensor(load), R), load, R))
    best = min(max(_rank_loads(list(p), load, R)) for p in itertools.permutations(range(len(load))))
    assert busiest <= 1.5 * best


def test_hot_experts_in_one_block_are_spread():
    """The recorded traces' case: the hot experts sit in one index block."""
    load = torch.tensor([9.0, 8, 7, 6, 1, 1, 1, 1])
    order = popular_order(load, 4)
    assert order == [0, 7, 1, 6, 2, 5, 3, 4]
    assert max(_rank_loads(order, load.tolist(), 4)) == 10.0  # the linear map: 17


def test_ties_keep_the_linear_map():
    assert popular_order(torch.zeros(10), 3) == list(range(10))
    assert popular_order(torch.ones(4, dtype=torch.int64), 8) == [0, 1, 2, 3]  # E < R


def _kept(a: list[int], b: list[int], R: int) -> int:
    """Experts owned by the same rank under orders ``a`` and ``b``."""
    edges = home_edges(len(a), R)
    return sum(len(set(a[edges[r] : edges[r + 1]]) & set(b[edges[r] : edges[r + 1]]))
               for r in range(R))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(load=_loads, R=st.integers(1, 9), rnd=st.randoms(use_true_random=False))
def test_a_current_order_changes_owners_not_the_busiest_rank(load, R, rnd):
    """With ``current``: the same groups (so the same rank loads, reordered), given to
    ranks that keep at least as many experts as without it, and half the best matching's
    (here bounded below by what the greedy's own order keeps)."""
    E = len(load)
    current = list(range(E))
    rnd.shuffle(current)
    plain = popular_order(torch.tensor(load, dtype=torch.float64), R)
    kept = popular_order(torch.tensor(load, dtype=torch.float64), R, current)
    same = sorted(_rank_loads(plain, load, R))  # the same sums, added in another order
    assert sorted(_rank_loads(kept, load, R)) == pytest.approx(same, rel=1e-12, abs=1e-12)
    assert _kept(kept, current, R) >= _kept(plain, current, R) / 2
    assert popular_order(torch.tensor(load, dtype=torch.float64), R, kept) == kept
    edges, place = home_edges(E, R), label_of(current)
    for r in range(R):  # each block in the current order: kept rows are not reordered
        block = kept[edges[r] : edges[r + 1]]
        assert block == sorted(block, key=place.__getitem__)


def test_a_current_order_that_is_a_rank_permutation_is_kept():
    load = torch.tensor([9.0, 8, 7, 6, 1, 1, 1, 1])
    plain = popular_order(load, 4)  # [0, 7 | 1, 6 | 2, 5 | 3, 4]
    swapped = plain[2:4] + plain[0:2] + plain[6:8] + plain[4:6]
    assert popular_order(load, 4, swapped) == swapped
    with pytest.raises(PlanError, match="each of the 8 experts once"):
        popular_order(load, 4, [0, 1, 2])


def test_a_current_order_with_unsorted_blocks_is_kept_row_for_row():
    """The same groups under a current order whose blocks are not ascending: nothing
    changes, not even the rows' order inside a rank (a re-home would move nothing)."""
    load = torch.tensor([9.0, 8, 7, 6, 1, 1, 1, 1])
    current = [7, 0, 6, 1, 5, 2, 4, 3]  # the groups of popular_order, each block reversed
    assert popular_order(load, 4, current) == current


def test_label_of_inverts_the_order():
    order = [3, 0, 2, 1]
    assert [label_of(order)[e] for e in order] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("load", "R", "match"),
    [
        (torch.ones(2, 2), 2, "1-D"),
        (torch.tensor([1.0, float("nan")]), 2, "finite"),
        (torch.tensor([1.0, -1.0]), 2, ">= 0"),
        (torch.tensor([True]), 1, "real"),
        ([1.0, 2.0], 2, "1-D"),
        (torch.ones(3), 0, "num_ranks"),
    ],
)
def test_bad_loads_are_named(load, R, match):
    with pytest.raises(PlanError, match=match):
        popular_order(load, R)


@pytest.mark.parametrize(
    ("order", "match"),
    [([0, 1, 1], "once"), ([0, 1], "once"), ("012", "sequence"), ([0, 1.0, 2], "sequence")],
)
def test_check_order_names_what_is_wrong(order, match):
    with pytest.raises(PlanError, match=match):
        check_order(order, 3)
    assert check_order(torch.tensor([2, 0, 1]), 3) == [2, 0, 1]
