"""The ``resident`` candidate: diffusion over the resident holders, in three forms alike.

Legend: R ranks, E experts, B slots, M = ceil(E/R); counts int64 ``[R, E]``; slots
``[R, B]`` (``-1`` empty); alloc ``[E, R]``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonplan.plan.choice import resident as res
from moonplan.plan.home import home_list, home_map
from moonplan.testing import counts
from moonplan.testing.bounds import least_largest_load


def _slots(data: st.DataObject, R: int, E: int) -> list[list[int]]:
    """A valid slot table: distinct experts per rank, none of the rank's own."""
    B = data.draw(st.integers(0, max(0, E - 1)))
    home = home_list(E, R)
    rows = []
    for r in range(R):
        pool = [e for e in range(E) if home[e] != r]
        picked = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=B)) if pool else []
        rows.append(picked + [-1] * (B - len(picked)))
    return rows


def _forms(c: torch.Tensor, slots: list[list[int]], tile: int = 1) -> list[torch.Tensor]:
    R, E = c.shape
    prev = torch.tensor(slots, dtype=torch.int64).reshape(R, -1)
    ref = torch.tensor(res.resident_reference(c.tolist(), slots, home_list(E, R), tile))
    home = home_map(E, R)
    host = torch.from_numpy(res.resident_host(c.numpy(), prev.numpy(), home.numpy(), tile))
    tensor = res.resident_torch(c, prev, home, tile)
    pairs = res.resident_pairs_torch(c, res.holders_torch(E, R, prev, home), tile)
    return [ref.reshape(E, R), host, tensor, pairs]


@given(
    counts(max_ranks=6, max_experts=12, max_records_per_rank=400),
    st.data(),
    st.sampled_from([1, 3, 16, 128]),
)
@settings(deadline=None, max_examples=60)
def test_several_tables_at_once_are_each_table_alone(
    c: torch.Tensor, data: st.DataObject, tile: int
) -> None:
    """``resident_tables_torch`` over 1-4 slot tables (empty ones among them): each table's
    plan is the host's for that table alone (no pair joins two tables)."""
    R, E = c.shape
    home = home_map(E, R)
    tables = [_slots(data, R, E) for _ in range(data.draw(st.integers(1, 4)))]
    prevs = [torch.tensor(t, dtype=torch.int64).reshape(R, -1) for t in tables]
    hold_TER = torch.stack([res.holders_torch(E, R, p, home) for p in prevs])
    got = res.resident_tables_torch(c, hold_TER, tile)
    for t, prev in enumerate(prevs):
        want = res.resident_host(c.numpy(), prev.numpy(), home.numpy(), tile)
        assert torch.equal(got[t], torch.from_numpy(want)), t


@given(
    counts(max_ranks=6, max_experts=12, max_records_per_rank=400),
    st.data(),
    st.sampled_from([1, 3, 16, 128]),
)
@settings(deadline=None, max_examples=60)
def test_each_table_may_bring_its_own_counts(
    c: torch.Tensor, data: st.DataObject, tile: int
) -> None:
    """``resident_tables_torch`` with counts ``[T, R, E]`` (one step per table, the window
    scores' gated entries): each table's plan is the host's for its own counts, and a
    table repeated with other counts does not mix with its twin."""
    R, E = c.shape
    home = home_map(E, R)
    n = data.draw(st.integers(1, 4))
    tables = [_slots(data, R, E) for _ in range(n)]
    tables += tables[:1]  # a twin with other counts
    prevs = [torch.tensor(t, dtype=torch.int64).reshape(R, -1) for t in tables]
    hold_TER = torch.stack([res.holders_torch(E, R, p, home) for p in prevs])
    scale = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=n + 1, max_size=n + 1)))
    counts_TRE = c[None] * scale[:, None, None] + torch.arange(n + 1)[:, None, None] % 2
    got = res.resident_tables_torch(counts_TRE, hold_TER, tile)
    for t, prev in enumerate(prevs):
        want = res.resident_host(counts_TRE[t].numpy(), prev.numpy(), home.numpy(), tile)
        assert torch.equal(got[t], torch.from_numpy(want)), t


def _tiles(rows: torch.Tensor, tile: int) -> torch.Tensor:
    """int64: ``rows`` each rounded up to whole tiles, in tiles."""
    return (rows + (tile - 1)) // tile


@given(
    counts(max_ranks=6, max_experts=12, max_records_per_rank=400),
    st.data(),
    st.sampled_from([1, 3, 16, 128]),
)
@settings(deadline=None)
def test_four_forms_agree_and_move_records_only_to_holders(
    c: torch.Tensor, data: st.DataObject, tile: int
) -> None:
    """The reference, the host's pairs, the dense torch form and the torch pairs form."""
    R, E = c.shape
    slots = _slots(data, R, E)
    ref, host, tensor, pairs = _forms(c, slots, tile)
    assert torch.equal(ref, host) and torch.equal(ref, tensor) and torch.equal(ref, pairs)
    assert bool((ref >= 0).all()) and torch.equal(ref.sum(1), c.sum(0))  # every record, once
    # whole tiles: no expert pads more tiles than its records need
    assert torch.equal(_tiles(ref, tile).sum(1), _tiles(c.sum(0), tile))
    M = -(-E // R)
    home = home_list(E, R)
    holders = {(e, home[e]) for e in range(E)}
    holders |= {(e, r) for r, row in enumerate(slots) for e in row[:M] if e >= 0}
    used = {(e, r) for e, r in zip(*ref.nonzero(as_tuple=True), strict=True)}
    assert {(int(e), int(r)) for e, r in used} <= holders


def test_a_cold_expert_stays_whole_on_one_holder() -> None:
    """30 records of a replicated expert are one tile on one holder, not two half tiles
    (balancing records split them, and each half padded to a tile of its own)."""
    c = torch.tensor([[30, 0], [0, 0]])  # expert 0 homed on rank 0, resident on rank 1
    slots = [[-1], [0]]
    by_records = _forms(c, slots, tile=1)[0]
    assert by_records[0].tolist() == [15, 15]
    for got in _forms(c, slots, tile=128):
        assert got[0].tolist() == [30, 0]


def test_a_hot_expert_splits_in_whole_tiles() -> None:
    """An expert of 3 tiles less 10 rows, held by two ranks beside a home expert of one
    tile: the ranks end with two tiles each, and only the last holder's tile is partial."""
    c = torch.tensor([[0, 0], [374, 100]])  # expert 0 homed on rank 0, resident on rank 1
    for got in _forms(c, [[-1], [0]], tile=128):
        assert got.tolist() == [[256, 118], [0, 100]]
        assert _tiles(got, 128).sum(0).tolist() == [2, 2]


def test_no_residents_is_static_ep() -> None:
    c = torch.tensor([[5, 0, 7], [1, 9, 0]])
    home = home_map(3, 2)
    static = torch.zeros(3, 2, dtype=torch.int64)
    static[torch.arange(3), home] = c.sum(0)
    assert torch.equal(res.resident_torch(c, None, home), static)
    assert res.resident_reference(c.tolist(), None, home_list(3, 2)) == static.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_reaches_near_the_least_largest_load_the_holders_allow(seed: int) -> None:
    """A skewed step over sparse holders (two slots per rank, the hottest experts twice):
    the 8 rounds end within 7% of the max-flow bound plus the whole-record rounding
    (measured: 1.000-1.065; 32 rounds reach 1.007), where the old one-hop rounds stalled
    far from it. The largest load never grows from one round to the next."""
    gen = np.random.default_rng(seed)
    R, E, B = 8, 32, 2
    pop = gen.lognormal(0, 1.5, E)
    c = torch.from_numpy(gen.multinomial(4000, pop / pop.sum(), size=R)).long()
    home = home_list(E, R)
    hot = sorted(range(E), key=lambda e: -pop[e])
    slots = [[-1] * B for _ in range(R)]
    for i, e in enumerate(x for x in hot for _ in range(2)):  # the hottest, twice each
        for r in sorted(range(R), key=lambda r: (sum(s >= 0 for s in slots[r]), (r + i) % R)):
            if home[e] != r and e not in slots[r] and -1 in slots[r]:
                slots[r][slots[r].index(-1)] = e
                break
    alloc = _forms(c, slots)[2]
    M = -(-E // R)
    holders = [[home[e]] + [r for r in range(R) if e in slots[r][:M]] for e in range(E)]
    best = least_largest_load(c.sum(0).tolist(), holders, R)
    assert int(alloc.sum(0).max()) <= best * 1.07 + M + B
    largest = []
    for rounds in (0, 2, 4, 8, 16):
        got = res.resident_torch(c, torch.tensor(slots), home_map(E, R), rounds=rounds)
        largest.append(int(got.sum(0).max()))
    assert largest == sorted(largest, reverse=True)


def test_a_unit_is_one_record_beyond_2_to_the_46() -> None:
    """Huge counts: the units stay in int64 (no wrap), every form alike."""
    c = torch.randint(0, 2**49, (4, 9), generator=torch.Generator().manual_seed(3))
    c[:, 2] += 2**50
    slots = [[2, 5], [2, 7], [0, 2], [1, 3]]
    ref, *others = _forms(c, slots)
    assert all(torch.equal(ref, got) for got in others)
    assert bool((ref >= 0).all()) and torch.equal(ref.sum(1), c.sum(0))
    assert res.scale_bits(2**46 - 1) == res.SCALE_BITS and res.scale_bits(2**46) == 0
