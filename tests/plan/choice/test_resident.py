"""The ``resident`` candidate: diffusion over the resident holders, in three forms alike.

Legend: R ranks, E experts, B slots, M = ceil(E/R); counts int64 ``[R, E]``; slots
``[R, B]`` (``-1`` empty); alloc ``[E, R]``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonplan.plan.choice import resident as res
from moonplan.plan.home import home_list, home_map
from moonplan.stepcost import StepCost
from moonplan.testing import counts
from moonplan.testing.bounds import least_largest_load

_ZERO = StepCost(*[0.0] * 11)
ROUND_COSTS = (
    _ZERO.scaled(row_flop_s=1e-7, round_s=7e-7),  # a round pays for 7 rows
    _ZERO.scaled(row_flop_s=1e-9, row_mem_s=2e-9, round_s=1e-6),  # 500 rows: often one round
    _ZERO.scaled(row_flop_s=1e-7),  # free rounds: while the largest load falls
    _ZERO.scaled(round_s=1e-6),  # rows cost nothing: one round
)
"""Cost models for the stop rule (``least_units``): from many rounds to one."""


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


def _built(
    c: torch.Tensor, slots: list[list[int]], tile: int = 1, cost: StepCost | None = None
) -> tuple[list[torch.Tensor], list[int]]:
    """Each form's allocation ``[E, R]`` and rounds: the reference, the host's pairs, the
    dense torch form and the torch pairs form."""
    R, E = c.shape
    prev = torch.tensor(slots, dtype=torch.int64).reshape(R, -1)
    ref, n_ref = res.resident_reference(c.tolist(), slots, home_list(E, R), tile, cost)
    home = home_map(E, R)
    host, n_host = res.resident_host(c.numpy(), prev.numpy(), home.numpy(), tile, cost)
    tensor, n_tensor = res.resident_torch(c, prev, home, tile, cost)
    pairs, n_pairs = res.resident_pairs_torch(c, res.holders_torch(E, R, prev, home), tile, cost)
    allocs = [torch.tensor(ref).reshape(E, R), torch.from_numpy(host), tensor, pairs]
    return allocs, [n_ref, n_host, int(n_tensor), int(n_pairs)]


def _forms(
    c: torch.Tensor, slots: list[list[int]], tile: int = 1, cost: StepCost | None = None
) -> list[torch.Tensor]:
    """Each form's allocation (:func:`_built`), their rounds checked equal."""
    allocs, rounds = _built(c, slots, tile, cost)
    assert len(set(rounds)) == 1, rounds
    return allocs


def _largest_by_round(c: torch.Tensor, slots: list[list[int]], tile: int = 1) -> list[int]:
    """The largest rank load in units before each round of the reference's diffusion and
    after the last, :data:`~moonplan.plan.choice.resident.ROUND_LIMIT` rounds in all."""
    return [top for top, _ in _tops_by_round(c, slots, tile)]


def _ties_by_round(c: torch.Tensor, slots: list[list[int]], tile: int = 1) -> list[int]:
    """How many ranks hold the largest load, before each round and after the last."""
    return [n for _, n in _tops_by_round(c, slots, tile)]


def _tops_by_round(c: torch.Tensor, slots: list[list[int]], tile: int = 1) -> list[tuple[int, int]]:
    """``(largest load, ranks at it)`` before each round and after the last."""
    R, E = c.shape
    T = c.sum(0).tolist()
    hold = res._holders_reference(E, R, slots, home_list(E, R))
    bits = res.scale_bits(sum(T))
    a = [[0] * R for _ in range(E)]
    for e in range(E):
        n, units = len(hold[e]), -(-T[e] // tile) << bits
        for i, r in enumerate(hold[e]):
            a[e][r] = units // n + (1 if i < units % n else 0)
    out = [res._top(res._loads_reference(a, R))]
    for _ in range(res.ROUND_LIMIT):
        res._round_reference(a, hold, R)
        out.append(res._top(res._loads_reference(a, R)))
    return out


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
    cost = data.draw(st.sampled_from([None, *ROUND_COSTS]))
    got, rounds = res.resident_tables_torch(c, hold_TER, tile, cost)
    for t, prev in enumerate(prevs):
        want, n = res.resident_host(c.numpy(), prev.numpy(), home.numpy(), tile, cost)
        assert torch.equal(got[t], torch.from_numpy(want)) and int(rounds[t]) == n, t


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
    cost = data.draw(st.sampled_from([None, *ROUND_COSTS]))
    got, rounds = res.resident_tables_torch(counts_TRE, hold_TER, tile, cost)
    for t, prev in enumerate(prevs):
        c_RE = counts_TRE[t].numpy()
        want, n = res.resident_host(c_RE, prev.numpy(), home.numpy(), tile, cost)
        assert torch.equal(got[t], torch.from_numpy(want)) and int(rounds[t]) == n, t


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
    """The reference, the host's pairs, the dense torch form and the torch pairs form: the
    same allocation and the same rounds, with or without a cost."""
    R, E = c.shape
    slots = _slots(data, R, E)
    cost = data.draw(st.sampled_from([None, *ROUND_COSTS]))
    ref, host, tensor, pairs = _forms(c, slots, tile, cost)
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
    assert torch.equal(res.resident_torch(c, None, home)[0], static)
    assert res.resident_reference(c.tolist(), None, home_list(3, 2)) == (static.tolist(), 1)


@pytest.mark.parametrize("seed", range(6))
def test_reaches_near_the_least_largest_load_the_holders_allow(seed: int) -> None:
    """A skewed step over sparse holders (two slots per rank, the hottest experts twice):
    without a cost the rounds run while the largest load falls and end within 1% of the
    max-flow bound plus the whole-record rounding (measured: 1.000-1.007), where the old one-hop
    rounds stalled far from it. The largest load never grows from one round to the
    next."""
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
    assert int(alloc.sum(0).max()) <= best * 1.01 + M + B
    largest = _largest_by_round(c, slots)
    assert largest == sorted(largest, reverse=True)


@given(
    counts(max_ranks=6, max_experts=12, max_records_per_rank=400),
    st.data(),
    st.sampled_from([1, 3, 16, 128]),
)
@settings(deadline=None, max_examples=60)
def test_the_rounds_stop_at_the_first_that_did_not_pay(
    c: torch.Tensor, data: st.DataObject, tile: int
) -> None:
    """Every round but the last lowered the largest load by at least ``least_units``; the
    last did not, or the limit was reached. At least one round runs."""
    R, E = c.shape
    slots = _slots(data, R, E)
    cost = data.draw(st.sampled_from([None, *ROUND_COSTS]))
    _, rounds = res.resident_reference(c.tolist(), slots, home_list(E, R), tile, cost)
    largest = _largest_by_round(c, slots, tile)
    least = res.least_units(cost, tile, res.scale_bits(int(c.sum())))
    drops = [a - b for a, b in itertools.pairwise(largest)]
    assert 1 <= rounds <= res.ROUND_LIMIT
    ties = _ties_by_round(c, slots, tile)
    went = [res.paid((largest[k], ties[k]), (largest[k + 1], ties[k + 1]), least)
            for k in range(res.ROUND_LIMIT)]  # fmt: skip
    assert all(went[: rounds - 1]) and (rounds == res.ROUND_LIMIT or not went[rounds - 1])
    assert all(d >= least or d == 0 for d in drops[: rounds - 1])


def test_ranks_tied_at_the_top_shed_one_after_another() -> None:
    """Ranks 1 and 2 tie at the largest load (270): a round lowers one of them and leaves
    the largest load where it was; the rounds go on (fewer ranks at the top) and end at 210,
    where stopping at the first round without a drop left 270."""
    c = torch.tensor([[60, 0, 120, 120], [0, 120, 0, 120], [0, 0, 120, 120], [0, 0, 60, 0]])
    slots = [[3], [2], [3], [-1]]
    largest = _largest_by_round(c, slots)
    assert largest[0] == largest[1] == 270 << 16 and largest[2] < largest[1]
    allocs, rounds = _built(c, slots)
    assert len(set(rounds)) == 1 and rounds[0] > 2
    assert all(int(a.sum(0).max()) == 210 for a in allocs)
    assert res.paid((5, 2), (5, 1), 1) and not res.paid((5, 2), (5, 2), 1)
    assert not res.paid((5, 2), (4, 1), 2) and not res.paid((5, 2), (5, 1), res.NEVER)


def test_least_units_is_the_least_drop_that_pays() -> None:
    """``least`` units of ``t`` rows at ``row_s`` a row are worth a round; one unit less is
    not. No cost or free rounds: one unit; rows that cost nothing: never."""
    for round_s, row_s, tile, bits in [(7e-7, 1e-7, 1, 16), (7.4e-7, 1.1e-7, 128, 16),
                                       (1e-6, 3e-9, 1, 0), (2e-6, 1e-6, 64, 0)]:  # fmt: skip
        cost = _ZERO.scaled(row_flop_s=row_s, round_s=round_s)
        least = res.least_units(cost, tile, bits)
        worth = tile * row_s / (1 << bits)  # seconds of one unit
        assert least * worth >= round_s * (1 - 1e-12) and (least - 1) * worth < round_s
    assert res.least_units(None, 1, 16) == 1 == res.least_units(_ZERO, 128, 16)
    assert res.least_units(_ZERO.scaled(round_s=1e-6), 1, 16) == res.NEVER
    assert res.least_units(_ZERO.scaled(round_s=1.0, row_mem_s=1e-300), 1, 16) == res.NEVER
    cheap = _ZERO.scaled(row_flop_s=1e-7, row_mem_s=3e-7, round_s=6e-7)  # the dearer rate
    assert res.least_units(cheap, 1, 0) == 2


def test_a_dear_round_runs_once_and_free_ones_until_the_load_stops_falling() -> None:
    """The same skewed step: a round dearer than any drop runs one round per build; free
    rounds run while the largest load falls; the allocations differ accordingly."""
    gen = np.random.default_rng(0)
    R, E = 8, 32
    pop = gen.lognormal(0, 1.5, E)
    c = torch.from_numpy(gen.multinomial(4000, pop / pop.sum(), size=R)).long()
    slots = [[(r * 4 + 5 + j) % E for j in range(4)] for r in range(R)]
    dear = _ZERO.scaled(row_flop_s=1e-12, round_s=1.0)
    one, n_one = _built(c, slots, 1, dear)
    free, n_free = _built(c, slots, 1, ROUND_COSTS[2])
    assert set(n_one) == {1} and len(set(n_free)) == 1 and n_free[0] > 1
    largest = _largest_by_round(c, slots)
    assert int(free[0].sum(0).max()) < int(one[0].sum(0).max())
    assert (
        n_free[0] == res.ROUND_LIMIT
        or largest[n_free[0]] == largest[n_free[0] - 1]
        or (largest[n_free[0] - 1] - largest[n_free[0]] < 1)
    )


def test_a_unit_is_one_record_beyond_2_to_the_46() -> None:
    """Huge counts: the units stay in int64 (no wrap), every form alike."""
    c = torch.randint(0, 2**49, (4, 9), generator=torch.Generator().manual_seed(3))
    c[:, 2] += 2**50
    slots = [[2, 5], [2, 7], [0, 2], [1, 3]]
    ref, *others = _forms(c, slots)
    assert all(torch.equal(ref, got) for got in others)
    assert bool((ref >= 0).all()) and torch.equal(ref.sum(1), c.sum(0))
    assert res.scale_bits(2**46 - 1) == res.SCALE_BITS and res.scale_bits(2**46) == 0
