"""The weighted lookup's weights: exact totals, the water-filling, and its batched torch form.

Legend: T tables, E experts, R ranks, B slots per rank.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moonplan.plan.home import home_list, home_map
from moonplan.plan.residency.serving import check_slots
from moonplan.plan.residency.shares import (
    SHARE_SCALE,
    pour_level,
    shares_reference,
    table_shares,
    weighted_alloc,
)
from moonplan.plan.torch_backend import resident_map
from moonplan.stepcost import StepCost
from moonplan.testing.tables import random_slot_tables
from tests.plan.choice.costs import COMPUTE_ONLY, DECODE, H200, MULTI

COSTS = [
    StepCost.from_hardware("h200-node", "deepseek-v3"),
    StepCost.from_hardware("h20-node", "deepseek-v3"),  # the memory side at decode sizes
    H200.scaled(domain=2),  # two-rank fast-link domains: the network's rows count
    MULTI,
    DECODE,  # a weight read is 50 rows: whether a holder runs an expert matters
    COMPUTE_ONLY,  # no read, no link: rows alone
]


def test_weighted_alloc_keeps_totals_and_gives_nothing_to_zero_weights() -> None:
    W = torch.tensor([[3, 0, 1, 0], [0, 0, 0, 5], [1, 1, 1, 1]])
    for T in ([7, 9, 10], [0, 1, 3], [1000, 999, 1]):
        a = weighted_alloc(torch.tensor(T), W)
        assert a.sum(1).tolist() == T
        assert bool((a >= 0).all()) and bool((a[W == 0] == 0).all())
    assert weighted_alloc(torch.tensor([8, 0, 4]), W).tolist() == [
        [6, 0, 2, 0],  # floor(8 * 3/4) = 6, then the running total's 8
        [0, 0, 0, 0],
        [1, 1, 1, 1],
    ]


def test_reference_fills_the_least_loaded_holder_first() -> None:
    cost = StepCost.from_hardware("h200-node", "deepseek-v3")  # any cost: a linear load
    E, R = 8, 4
    home = home_map(E, R)  # two experts a rank: 0 and 1 on rank 0
    mean_E = torch.tensor([400.0, 10, 10, 10, 10, 10, 10, 10])  # expert 0 hot
    resident_ER = torch.zeros(E, R, dtype=torch.bool)
    resident_ER[0, 1] = resident_ER[0, 2] = True  # expert 0 also on ranks 1 and 2
    W = shares_reference(cost, mean_E, resident_ER)
    assert W[0, 3] == 0  # not a holder
    assert bool((W[1:] == SHARE_SCALE * (home[1:, None] == torch.arange(R))).all())
    # its home runs one other expert, ranks 1 and 2 two each: the home takes the most
    assert W[0, 0] > W[0, 1] and W[0, 1] == W[0, 2]


@given(
    st.floats(0, 1e6),
    st.lists(st.floats(0, 1e6), min_size=1, max_size=12),
)
def test_pour_level_is_where_the_total_fills_up_to(total: float, levels: list[float]) -> None:
    c = sorted(levels)
    level = pour_level(total, c)
    assert level >= c[0]
    poured = sum(max(0.0, level - x) for x in c)
    assert poured == pytest.approx(total, rel=1e-9, abs=1e-6)


@st.composite
def tables(draw: st.DrawFn) -> tuple[StepCost, torch.Tensor, torch.Tensor]:
    """A cost, a mean step ``[E]`` and ``T`` valid slot tables ``[T, R, B]``: no rank holds
    its own home expert or an expert twice; the means with zeros, ties, fractions and
    sometimes one expert far hotter than the rest."""
    E, R = draw(st.integers(1, 40)), draw(st.integers(1, 8))
    B, T = draw(st.integers(0, 3)), draw(st.integers(1, 4))
    home = home_list(E, R)
    slot_TRB = torch.full((T, R, B), -1, dtype=torch.int64)
    for t in range(T):
        for r in range(R):
            away = [e for e in range(E) if home[e] != r]
            held = draw(st.permutations(away))[: draw(st.integers(0, min(B, len(away))))]
            row = draw(st.permutations(held + [-1] * (B - len(held))))
            slot_TRB[t, r] = torch.tensor(row, dtype=torch.int64)
    kind = draw(st.sampled_from(["counts", "fractions", "floats", "equal"]))
    if kind == "equal":
        mean = [float(draw(st.integers(1, 9)))] * E
    elif kind == "floats":
        mean = draw(st.lists(st.floats(0, 500) | st.just(0.0), min_size=E, max_size=E))
    else:  # a window's mean of counts: whole, or over 3 steps (no exact binary fraction)
        steps = 1 if kind == "counts" else 3
        mean = [n / steps for n in draw(st.lists(st.integers(0, 12), min_size=E, max_size=E))]
    hot = draw(st.none() | st.integers(0, E - 1))
    if hot is not None:
        mean[hot] = 1000.0 * (max(mean) + 1)
    cost = draw(st.sampled_from(COSTS))
    return cost, torch.tensor(mean, dtype=torch.float64), slot_TRB


def _reference(
    cost: StepCost, mean_E: torch.Tensor, slot_TRB: torch.Tensor, passes: int = 3
) -> torch.Tensor:
    """int64 ``[T, E, R]``: :func:`shares_reference` of each table, stacked."""
    E = mean_E.shape[0]
    return torch.stack(
        [shares_reference(cost, mean_E, resident_map(s, E), passes) for s in slot_TRB]
    )


def _holders(slot_TRB: torch.Tensor, E: int) -> torch.Tensor:
    """bool ``[T, E, R]``: each table's holders, the homes included."""
    R = slot_TRB.shape[1]
    home_ER = home_map(E, R)[:, None] == torch.arange(R)
    return torch.stack([resident_map(s, E) | home_ER for s in slot_TRB])


@given(tables(), st.integers(0, 3))
def test_table_shares_equals_the_reference(
    case: tuple[StepCost, torch.Tensor, torch.Tensor], passes: int
) -> None:
    # The batched form does the reference's float arithmetic in the reference's order,
    # so the two agree to the unit, even at a tie between running an expert or not
    # (which moves a weight read's worth of load, and so every share after it).
    cost, mean_E, slot_TRB = case
    got = table_shares(cost, mean_E, slot_TRB, passes)
    T, R, _ = slot_TRB.shape
    assert got.dtype == torch.int64 and got.shape == (T, len(mean_E), R)
    assert torch.equal(got, _reference(cost, mean_E, slot_TRB, passes))


@given(tables())
def test_table_shares_sum_to_the_scale_on_the_holders_alone(
    case: tuple[StepCost, torch.Tensor, torch.Tensor],
) -> None:
    cost, mean_E, slot_TRB = case
    weight_TER = table_shares(cost, mean_E, slot_TRB)
    R = slot_TRB.shape[1]
    assert bool((weight_TER >= 0).all())
    assert not bool(weight_TER[~_holders(slot_TRB, len(mean_E))].any())
    # each of at most R holders rounds its weight by at most a half
    assert bool(((weight_TER.sum(2) - SHARE_SCALE).abs() <= R / 2 + 1).all())


ADVERSARIAL = [  # (mean_E, slot table [R][B]): ties, exact fills, zeros, one rank
    ([10.0, 10.0], [[-1], [0]]),  # the pour fills the home exactly to the other's level
    ([0.2, 0.1, 0.3], [[-1], [0]]),  # 0.1 + 0.2 > 0.3 by an ulp: an ulp's share on rank 1
    ([5.0] * 8, [[2, 4], [0, 6], [1, 7], [3, 5]]),  # every expert on two ranks, all equal
    ([0.0, 7.0, 0.0, 7.0], [[3, 2], [0, 1]]),  # replicas of experts without records
    ([3.0, 1e-300, 4.0, 2.0], [[2, 3], [0, 1]]),  # a share too small to weigh
    ([1e9, 1.0, 1.0, 1.0, 1.0, 1.0], [[5], [0], [0]]),  # one expert far hotter
    ([6.0, 3.0, 3.0], [[-1, -1]]),  # one rank: everything at home
    ([9.0, 0.0, 0.0], [[-1], [0], [0], [0], [-1]]),  # E < R, replicas of expert 0
]


@pytest.mark.parametrize(("mean", "table"), ADVERSARIAL)
@pytest.mark.parametrize("cost", COSTS, ids=range(len(COSTS)))
def test_table_shares_equals_the_reference_on_adversarial_tables(
    mean: list[float], table: list[list[int]], cost: StepCost
) -> None:
    mean_E = torch.tensor(mean, dtype=torch.float64)
    check_slots(torch.tensor(table), len(table), len(mean))
    empty = [[-1] * len(table[0]) for _ in table]
    slot_TRB = torch.tensor([table, empty, table], dtype=torch.int64)
    assert torch.equal(table_shares(cost, mean_E, slot_TRB), _reference(cost, mean_E, slot_TRB))


@pytest.mark.gpu
def test_table_shares_on_cuda_agree_with_the_host() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # CUDA sums in another order than the host: a weight may differ by a unit or two
    g = torch.Generator().manual_seed(0)
    for E, R, B, T in [(8, 4, 2, 3), (64, 8, 2, 8), (256, 64, 2, 32)]:
        mean_E = torch.exp(2 * torch.randn(E, generator=g, dtype=torch.float64)) * 50
        slot_TRB = random_slot_tables(E, R, B, T, g)
        for cost in COSTS:
            want = table_shares(cost, mean_E, slot_TRB)
            got = table_shares(cost, mean_E, slot_TRB.cuda())
            assert got.device.type == "cuda"
            assert int((got.cpu() - want).abs().max()) <= 2
