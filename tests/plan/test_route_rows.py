"""Unique (token, destination) rows and affinity: the vectorised route equals the
plain-Python reference bit for bit; the token-buffer contract holds; affinity keeps
every count and offset set of the plan and never sends more rows."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import moonplan
from moonplan.plan.route_reference import route_reference
from moonplan.plan.route_rows import pair_records, token_block_start
from moonplan.testing import allocs, counts, plan_options

FIELDS = (
    "dest_rank",
    "dest_offset",
    "send_counts",
    "unique_token",
    "unique_dest",
    "unique_offset",
    "record_unique",
    "unique_counts",
)


def _ids_for(counts_E: list[int], K: int, seed: int, shuffle: bool) -> torch.Tensor:
    """``[S, K]`` ids with exactly these counts (``sum % K == 0``); unshuffled, tokens
    repeat one expert (duplicate ids inside a token)."""
    flat = torch.tensor([e for e, n in enumerate(counts_E) for _ in range(n)], dtype=torch.int64)
    if shuffle:
        flat = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed))]
    return flat.view(-1, K)


@st.composite
def routed(draw: st.DrawFn) -> tuple[moonplan.Plan, list[torch.Tensor]]:
    """A plan (planner or an arbitrary split from ``allocs``) and every rank's ids."""
    c = draw(counts(max_ranks=5, max_experts=12, max_records_per_rank=40))
    R, E = c.shape
    K = draw(st.integers(1, 4), label="K")
    c = c.clone()
    for s in range(R):  # trim each source to a multiple of K records
        extra = int(c[s].sum()) % K
        while extra:
            e = int(torch.argmax(c[s]))
            take = min(extra, int(c[s, e]))
            c[s, e] -= take
            extra -= take
    opts = draw(plan_options(R, E))
    if draw(st.booleans(), label="from_alloc"):
        p = moonplan.Plan.from_alloc(
            c, draw(allocs(c, slots=opts["slots"])), slots=opts["slots"], align=opts["align"]
        )
    else:
        p = moonplan.plan(c, **opts)
    seed = draw(st.integers(0, 2**16), label="seed")
    shuffle = draw(st.booleans(), label="shuffle")
    ids = [_ids_for(c[s].tolist(), K, seed + s, shuffle) for s in range(R)]
    return p, ids


@given(routed(), st.booleans())
def test_route_equals_reference(case: tuple, affinity: bool) -> None:
    p, ids = case
    for s, x in enumerate(ids):
        got = moonplan.route(p, s, x, affinity=affinity)
        want = route_reference(p, s, x, affinity=affinity)
        for f in FIELDS:
            assert getattr(got, f).reshape(-1).tolist() == want[f], f
        assert got.sent_rows == len(want["unique_token"])


@given(routed(), st.booleans())
def test_token_buffer_contract(case: tuple, affinity: bool) -> None:
    """Sources write unique rows into disjoint, plan-known blocks; a local gather by the
    per-record ints rebuilds exactly what per-record dispatch writes."""
    p, ids = case
    R = p.num_ranks
    n_SD = pair_records(p)
    start_SD = torch.cumsum(n_SD, 0) - n_SD
    for s in range(R):
        assert token_block_start(p, s).tolist() == start_SD[s].tolist()
    tok = [torch.full((int(n),), -1, dtype=torch.int64) for n in p.target.tolist()]
    grouped = [torch.full((int(n),), -1, dtype=torch.int64) for n in p.recv_size().tolist()]
    at = [torch.full((int(n),), -1, dtype=torch.int64) for n in p.recv_size().tolist()]
    for s, x in enumerate(ids):
        rt = moonplan.route(p, s, x, affinity=affinity)
        assert rt.send_counts.tolist() == n_SD[s].tolist(), "block capacity != records sent"
        assert int(rt.unique_counts.sum()) == rt.sent_rows
        assert bool((rt.unique_counts <= rt.send_counts).all())
        pairs = list(zip(rt.unique_dest.tolist(), rt.unique_token.tolist(), strict=True))
        assert pairs == sorted(set(pairs)), "rows not unique or not sorted"
        u_N = rt.record_unique.reshape(-1)
        assert rt.unique_dest[u_N].tolist() == rt.dest_rank.reshape(-1).tolist()
        tok_N = torch.arange(x.numel()) // max(x.shape[1], 1)
        assert rt.unique_token[u_N].tolist() == tok_N.tolist()
        for d, t, o in zip(
            *(v.tolist() for v in (rt.unique_dest, rt.unique_token, rt.unique_offset)), strict=True
        ):
            assert int(start_SD[s, d]) <= o < int(start_SD[s, d] + n_SD[s, d]), "outside block"
            assert tok[d][o] == -1, "token row written twice"
            tok[d][o] = s * 10**6 + t
        for i, (d, o, row) in enumerate(
            zip(
                *(v.reshape(-1).tolist() for v in (rt.dest_rank, rt.dest_offset, rt.token_row())),
                strict=True,
            )
        ):
            grouped[d][o] = s * 10**6 + int(tok_N[i])  # what per-record dispatch writes
            at[d][o] = row
    for d in range(R):
        valid = at[d] >= 0
        assert torch.equal(tok[d][at[d][valid]], grouped[d][valid])
        assert torch.equal(valid, grouped[d] >= 0)


@given(routed())
def test_affinity_keeps_the_plan_and_never_sends_more(case: tuple) -> None:
    p, ids = case
    E = p.num_experts
    for s, x in enumerate(ids):
        a = moonplan.route(p, s, x, affinity=True)
        b = moonplan.route(p, s, x, affinity=False)
        e_N = x.reshape(-1)
        for rt in (a, b):
            assert rt.dest_rank.shape == x.shape
        key_a = a.dest_rank.reshape(-1) * E + e_N
        key_b = b.dest_rank.reshape(-1) * E + e_N
        assert torch.equal(
            torch.bincount(key_a, minlength=p.num_ranks * E),
            torch.bincount(key_b, minlength=p.num_ranks * E),
        )
        sa = sorted(
            zip(a.dest_rank.reshape(-1).tolist(), a.dest_offset.reshape(-1).tolist(), strict=True)
        )
        sb = sorted(
            zip(b.dest_rank.reshape(-1).tolist(), b.dest_offset.reshape(-1).tolist(), strict=True)
        )
        assert sa == sb, "receive offsets changed"
        assert a.sent_rows <= b.sent_rows


def test_affinity_follows_the_token() -> None:
    """Expert 1 is split over ranks 0 and 1; token 1 already goes to rank 1 (expert 3),
    so its expert-1 record goes there too, where plain order sends it to rank 0."""
    ids = torch.tensor([[1, 0], [1, 3]])
    c = torch.tensor([[1, 2, 0, 1], [0, 0, 0, 0]])
    alloc = torch.tensor([[1, 0], [1, 1], [0, 0], [0, 1]])
    p = moonplan.Plan.from_alloc(c, alloc)
    plain = moonplan.route(p, 0, ids, affinity=False)
    aff = moonplan.route(p, 0, ids, affinity=True)
    assert plain.dest_rank.tolist() == [[0, 0], [1, 1]]
    assert plain.sent_rows == 2  # no gain possible here: already one rank per token
    assert aff.dest_rank.tolist() == [[0, 0], [1, 1]]
    ids = torch.tensor([[1, 3], [1, 0]])
    plain = moonplan.route(p, 0, ids, affinity=False)
    aff = moonplan.route(p, 0, ids, affinity=True)
    assert plain.dest_rank.tolist() == [[0, 1], [1, 0]] and plain.sent_rows == 4
    assert aff.dest_rank.tolist() == [[1, 1], [0, 0]] and aff.sent_rows == 2
    assert sorted(aff.dest_offset.reshape(-1).tolist()) == sorted(
        plain.dest_offset.reshape(-1).tolist()
    )


def _fallback_case() -> tuple[moonplan.Plan, torch.Tensor]:
    """Rank 3's expert-0 records are split 28 / 1 over ranks 0 and 1. The greedy gives
    rank 0's share first to token 7 (already there), which pushes one of tokens 0-6
    to rank 1: one row more than plain order, so plain order is kept (found by search)."""
    c = torch.tensor(
        [
            [3, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0],
            [6, 1, 1, 0, 0, 0],
            [29, 2, 2, 1, 1, 1],
            [0, 0, 0, 0, 0, 0],
        ]
    )
    alloc = torch.tensor(
        [
            [37, 1, 0, 0, 0],
            [4, 0, 0, 0, 0],
            [0, 3, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [1, 0, 0, 0, 0],
        ]
    )
    p = moonplan.Plan.from_alloc(c, alloc)
    x = torch.tensor([[0, 0, 0, 0]] * 7 + [[0, 1, 1, 2], [2, 3, 4, 5]])
    return p, x


def test_affinity_falls_back_when_the_greedy_loses() -> None:
    """The greedy sends one row more than plain order here (:func:`_fallback_case`)."""
    p, x = _fallback_case()
    want = route_reference(p, 3, x, affinity=True)
    plain = moonplan.route(p, 3, x, affinity=False)
    aff = moonplan.route(p, 3, x, affinity=True)
    assert aff.sent_rows == plain.sent_rows == len(want["unique_token"])
    assert aff.dest_rank.reshape(-1).tolist() == plain.dest_rank.reshape(-1).tolist()


class _HostReads(TorchDispatchMode):
    """Counts host reads of tensor values (``int()``, ``bool()``, ``.item()``) while on."""

    def __init__(self) -> None:
        super().__init__()
        self.reads, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default and not self.paused:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_route_reads_one_value_beyond_the_affinity_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """With affinity, ``route`` compares the two row counts in one host read (besides the
    rule's own); the token-buffer block starts are built only with the unique rows."""
    route_mod = importlib.import_module("moonplan.plan.route")  # the package exports route()

    p, x = _fallback_case()
    counter = _HostReads()
    real_cells, real_start = route_mod.affinity_cells, route_mod.token_block_start
    starts: list[int] = []

    def cells(*args):  # type: ignore[no-untyped-def]
        counter.paused = True
        try:
            return real_cells(*args)
        finally:
            counter.paused = False

    monkeypatch.setattr(route_mod, "affinity_cells", cells)
    monkeypatch.setattr(
        route_mod, "token_block_start", lambda p, s: starts.append(s) or real_start(p, s)
    )
    for affinity, want in ((False, 0), (True, 1)):
        counter.reads = 0
        with counter:
            rt = moonplan.route(p, 3, x, check=False, affinity=affinity)
        assert counter.reads == want, affinity
    assert starts == []  # not built by route itself
    assert rt.sent_rows == len(route_reference(p, 3, x, affinity=True)["unique_token"])
    assert starts == [3] and torch.equal(rt.block_start, token_block_start(p, 3))
