"""``auto``'s early-exit bound (``moonplan/plan/choice/bound.py``): its terms on hand cases.

Legend: R ranks, E experts, M = ceil(E/R), w seconds of one weight read (100 in ``DECODE``).

That the bound never exceeds a candidate that copies is checked on random counts and costs
in ``test_choice.py``; here each term is computed by hand where it decides.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from moonplan.plan.choice import choose, reference
from moonplan.plan.choice.bound import (
    MARGIN,
    exit_bound,
    exit_bound_torch,
    experts_lb_s,
    kept_section_host,
    kept_section_s,
    kept_section_torch,
    links_host,
    links_reference,
    links_torch,
    totals_torch,
)
from moonplan.plan.home import home_list
from moonplan.stepcost import StepCost
from moonplan.testing import counts
from tests.plan.choice.costs import DECODE, costs, full, rows_only


def test_a_rank_that_receives_a_copy_reads_its_kept_experts_and_the_copy() -> None:
    """Every expert has records, so every rank reads its 2 home experts whatever the plan. A
    copy saves its receiver 10 rows a direction, but the receiver also reads the copy beside
    its home section and again to run it: 4 reads, not 2. Without that term the bound was
    the least rows a rank must send (j = 2: 40 + 2w + 40 = 280 s) and static EP (320 s) paid
    a full call; with it, every plan that copies takes at least 50 + 4w + 50 = 500 s (and a
    planner call of 1 s)."""
    c = torch.full((4, 8), 10, dtype=torch.int64)
    cost = DECODE
    R, E = c.shape
    home = home_list(E, R)
    links = links_reference(c.tolist(), set(), home, cost.domain_size(R))
    assert links[2] == [2, 2, 2, 2]  # kept reads: every home expert has records
    totals = reference._totals(cost, c.tolist())
    _, copies = exit_bound(cost, R, totals, links, None)
    assert copies == 501.0 * MARGIN
    p = choose(c, 2, 1, None, cost, "reference")
    assert p.choice is not None and p.choice.early_exit() and p.policy == "static"
    every = choose(c, 2, 1, None, full(cost), "reference").choice
    assert every is not None  # each candidate is static EP's plan (321 s) or copies
    assert all(float(s) == 321.0 or float(s) >= 501.0 for s in every.scores)


def test_the_slowest_rank_runs_a_whole_number_of_tiles() -> None:
    """Tiles of 16 rows: 112 padded rows over 4 ranks is 28 a rank on average, but a rank's
    padded rows are a multiple of 16, so the slowest runs at least 32 (static EP's)."""
    cost = rows_only(tile_rows=16)
    c = torch.tensor([[20, 20, 20, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    tiles, busy, N = reference._totals(cost, c.tolist())
    assert (tiles, busy, N) == (112, 4, 61)
    assert experts_lb_s(cost, 4, tiles, busy, N) == 32 * cost.row_flop_s
    static = choose(c, 0, 1, None, full(cost), "reference").choice
    assert static is not None
    assert float(static.scores[0]) >= 32 * cost.row_flop_s


@given(counts(max_ranks=8, max_experts=20, max_records_per_rank=200), st.data())
def test_the_link_rows_are_the_same_in_every_form(c: torch.Tensor, data: st.DataObject) -> None:
    """``links_reference``, ``links_host`` and ``links_torch`` on random counts, resident
    pairs and domain sizes."""
    R, E = c.shape
    flags = data.draw(st.lists(st.booleans(), min_size=E * R, max_size=E * R))
    resident = torch.tensor(flags, dtype=torch.bool).reshape(E, R)
    G = data.draw(st.integers(1, R))
    home = home_list(E, R)
    pairs = {(e, r) for e in range(E) for r in range(R) if resident[e, r]}
    want = links_reference(c.tolist(), pairs, home, G)
    home_E = torch.tensor(home, dtype=torch.int64)
    assert links_host(c.numpy(), resident.numpy(), home_E.numpy(), G) == want
    assert tuple(x.tolist() for x in links_torch(c, resident, home_E, G)) == want


@given(counts(max_ranks=8, max_experts=20, max_records_per_rank=200), costs(), st.data())
def test_the_exit_bound_is_the_same_in_every_form(
    c: torch.Tensor, cost: StepCost, data: st.DataObject
) -> None:
    """``exit_bound`` and ``exit_bound_torch`` give equal floats (and ``totals_torch`` the
    reference's sums) on random counts, resident
    pairs and costs (either schedule, one or several domains), with and without static
    EP's full time (``residency.window_torch`` relies on it)."""
    R, E = c.shape
    flags = data.draw(st.lists(st.booleans(), min_size=E * R, max_size=E * R))
    resident = torch.tensor(flags, dtype=torch.bool).reshape(E, R)
    home = home_list(E, R)
    home_E = torch.tensor(home, dtype=torch.int64)
    links = links_host(c.numpy(), resident.numpy(), home_E.numpy(), cost.domain_size(R))
    totals = reference._totals(cost, c.tolist())
    assert tuple(int(x) for x in totals_torch(cost, c.sum(0))) == totals
    full_s = data.draw(st.sampled_from([None, 0.0, 1e-4, 1.0]))
    want = exit_bound(cost, R, totals, links, full_s)
    t = tuple(torch.tensor(x, dtype=torch.int64) for x in totals)
    tl = tuple(torch.tensor(x, dtype=torch.int64) for x in links)
    static_t = torch.tensor(math.inf if full_s is None else full_s, dtype=torch.float64)
    got = exit_bound_torch(cost, R, t, tl, static_t, torch.tensor(full_s is None))
    assert (float(got[0]), float(got[1])) == want


@given(counts(max_ranks=8, max_experts=20, max_records_per_rank=200), costs(), st.data())
def test_the_kept_section_is_the_same_in_every_form(
    c: torch.Tensor, cost: StepCost, data: st.DataObject
) -> None:
    """``kept_section_s``, ``kept_section_host`` and ``kept_section_torch`` give equal
    floats on random counts, resident pairs and costs."""
    R, E = c.shape
    flags = data.draw(st.lists(st.booleans(), min_size=E * R, max_size=E * R))
    resident = torch.tensor(flags, dtype=torch.bool).reshape(E, R)
    home = home_list(E, R)
    home_E = torch.tensor(home, dtype=torch.int64)
    pairs = {(e, r) for e in range(E) for r in range(R) if resident[e, r]}
    want = kept_section_s(cost, c.tolist(), pairs, home)
    assert kept_section_host(cost, c.numpy(), resident.numpy(), home_E.numpy()) == want
    assert float(kept_section_torch(cost, c, resident, home_E)) == want


def test_a_rank_runs_all_rows_of_its_experts_without_a_replica() -> None:
    """Expert 0 (rank 0's) is replicated on rank 1; rank 1's expert 1 is not, and its 300
    records have nowhere else to go: every plan that copies nothing runs them there, 3
    tiles of 128 rows. The kept section is that roofline, where the weight reads alone
    (the older term) were one read."""
    cost = rows_only(tile_rows=128, weight_read_s=1e-5)
    c = torch.tensor([[100, 150], [100, 150]])
    pairs = {(0, 1)}
    want = max(384 * cost.row_flop_s, cost.weight_read_s + 300 * cost.row_mem_s)
    assert kept_section_s(cost, c.tolist(), pairs, [0, 1]) == want
    assert want > cost.weight_read_s


def test_two_ranks_run_an_expert_replicated_only_between_them_with_their_kept_ones() -> None:
    """Expert 0 (rank 0's, 60 records) is resident on rank 1 alone. Every plan that copies
    nothing runs it on rank 0 or 1, beside rank 0's kept expert 1 (2 tiles of 128 rows) and
    rank 1's kept experts 2 and 3 (a tile each): 5 tiles on two ranks, so one runs 3. Each
    rank alone keeps 2 tiles; the pair bound is the tighter, in every form."""
    cost = rows_only(tile_rows=128, weight_read_s=1e-9)
    c = torch.tensor([[60, 100, 60, 60], [0, 100, 0, 0]])
    home = [0, 0, 1, 1]
    resident = torch.zeros(4, 2, dtype=torch.bool)
    resident[0, 1] = True
    want = 3 * 128 * cost.row_flop_s
    assert kept_section_s(cost, c.tolist(), {(0, 1)}, home) == want
    home_E = torch.tensor(home)
    assert kept_section_host(cost, c.numpy(), resident.numpy(), home_E.numpy()) == want
    assert float(kept_section_torch(cost, c, resident, home_E)) == want
    resident[0, 0] = True  # two resident pairs (one on its home): no pair term
    assert float(kept_section_torch(cost, c, resident, home_E)) == 2 * 128 * cost.row_flop_s
