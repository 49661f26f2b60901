"""Token-level routing: sampled top-k sets follow the workload; rows per record."""

from __future__ import annotations

import math

import pytest
import torch

from moonplan.simulate.models import get_model
from moonplan.simulate.token_routing import (
    GROUP_LIMITS,
    drifting_tokens,
    group_limit,
    inclusion_rate,
    sample_topk,
    token_counts,
    token_trace,
)
from moonplan.simulate.workload import (
    drifting_counts,
    drifting_popularity,
    inclusion_probability,
)
from moonplan.stepcost.traffic import rows_per_record


def _static_dest(ids_RSK: torch.Tensor, experts: int, ranks: int) -> torch.Tensor:
    return ids_RSK.to(torch.int64) // (experts // ranks)  # linear placement, E divisible by R


@pytest.mark.parametrize("groups", [None, (8, 4)])
def test_sampled_sets_are_distinct_and_in_range(groups: tuple[int, int] | None) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, dtype=torch.float64) * 2.0
    ids = sample_topk(logits, 5000, 8, gen, groups)
    assert ids.shape == (5000, 8) and int(ids.min()) >= 0 and int(ids.max()) < 64
    s, _ = ids.sort(1)
    assert bool((s[:, 1:] != s[:, :-1]).all())  # K distinct experts per token
    if groups is not None:  # at most topk_group groups per token
        g, _ = (ids // 8).sort(1)
        assert int((1 + (g[:, 1:] != g[:, :-1]).sum(1)).max()) <= 4


@pytest.mark.parametrize("groups", [None, (2, 1)])
def test_a_dominant_expert_falls_back_to_masked_draws(groups: tuple[int, int] | None) -> None:
    # expert 0 takes almost all the weight: after it, rejection keeps redrawing it
    logits = torch.tensor([30.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    ids = sample_topk(logits, 20, 3, torch.Generator().manual_seed(0), groups)
    s, _ = ids.sort(1)
    assert bool((s[:, 0] == 0).all()) and bool((s[:, 1:] != s[:, :-1]).all())
    if groups is not None:  # one group of 3: experts 0, 1, 2
        assert int(ids.max()) <= 2
    with pytest.raises(ValueError, match="positive"):
        sample_topk(torch.tensor([0.0, 0.0, -math.inf]), 2, 3, torch.Generator())


def test_plain_topk_inclusion_matches_workload() -> None:
    pop = next(drifting_popularity(64, sigma=1.0, steps=1, seed=1))
    ids = next(drifting_tokens([pop], 8, 4000, 8, seed=1))
    got = inclusion_rate(ids.reshape(-1, 8).long(), 64)
    want = inclusion_probability(pop, 8)
    # the Poisson approximation is ~1% off the exact law; sampling noise ~1.6% here
    assert float((got - want).abs().sum() / want.sum()) < 0.04


@pytest.mark.parametrize("groups", [None, (8, 4)])
def test_counts_match_the_workload(groups: tuple[int, int] | None) -> None:
    # the same drifting popularity, routed as counts (fast sampler) and as tokens
    T, R, E, S, K = 3, 8, 64, 2000, 8
    counts = drifting_counts(R, E, S, K, sigma=0.5, steps=T, seed=2).sum(1).double()
    pops = drifting_popularity(E, sigma=0.5, steps=T, seed=2)
    toks = drifting_tokens(pops, R, S, K, seed=3, groups=groups)
    for c_E, ids in zip(counts, toks, strict=True):
        tc = token_counts(ids, E)
        assert tc.shape == (R, E) and bool((tc.sum(1) == S * K).all())
        assert float((tc.sum(0) - c_E).abs().sum() / c_E.sum()) < 0.06


def test_a_different_workload_is_detected() -> None:
    # guard that the tolerance above can fail: another popularity is far off
    counts = drifting_counts(8, 64, 2000, 8, sigma=0.5, steps=1, seed=2).sum(1)[0].double()
    pop = next(drifting_popularity(64, sigma=0.5, steps=1, seed=9))
    other = token_counts(next(drifting_tokens([pop], 8, 2000, 8)), 64)
    assert float((other.sum(0) - counts).abs().sum() / counts.sum()) > 0.1


def test_rows_per_record_uniform_and_group_limited() -> None:
    R, E, S, K = 8, 64, 4000, 8
    uniform = [torch.full((E,), 1.0 / E, dtype=torch.float64)]
    plain = next(drifting_tokens(uniform, R, S, K))
    grouped = next(drifting_tokens(uniform, R, S, K, groups=(8, 4)))
    rpr_plain = rows_per_record(_static_dest(plain, E, R), "rank", R)
    rpr_group = rows_per_record(_static_dest(grouped, E, R), "rank", R)
    # uniform top-8 of 64 on 8 ranks: E[distinct ranks] = 8 * (1 - C(56,8)/C(64,8)) = 5.40
    assert rpr_plain == pytest.approx(0.675, abs=0.01)
    assert rpr_group <= 0.5  # groups of 8 = ranks of 8: at most 4 ranks per token
    assert rows_per_record(_static_dest(plain, E, R), "record", R) == 1.0


def test_group_limits_and_determinism() -> None:
    assert group_limit("DeepSeek-V3") == (8, 4) == GROUP_LIMITS["deepseek-v3"]
    assert group_limit("mixtral-8x7b") is None
    pops = list(drifting_popularity(16, sigma=1.0, steps=2, seed=4))
    a = list(drifting_tokens(pops, 2, 50, 2, seed=4, groups=(4, 2)))
    b = list(drifting_tokens(pops, 2, 50, 2, seed=4, groups=(4, 2)))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    with pytest.raises(ValueError):
        sample_topk(torch.zeros(10), 5, 2, torch.Generator(), (3, 1))  # 3 does not divide 10
    with pytest.raises(ValueError):
        sample_topk(torch.zeros(8), 5, 6, torch.Generator(), (4, 1))  # 6 > 1 group of 2


def test_popularity_is_the_workload_sequence() -> None:
    # drifting_counts (fast sampler) routes by these popularities: same mean counts
    pops = torch.stack(list(drifting_popularity(32, sigma=1.0, steps=3, seed=6)))
    counts = drifting_counts(64, 32, 500, 4, sigma=1.0, steps=3, seed=6).sum(1).double()
    want = torch.stack([inclusion_probability(p, 4) for p in pops]) * 64 * 500
    assert float((counts - want).abs().sum() / want.sum()) < 0.03
    for bad in (-1.0, float("nan")):  # the same checks as drifting_counts
        with pytest.raises(ValueError, match="sigma must be"):
            next(drifting_popularity(4, sigma=bad, steps=1))
        with pytest.raises(ValueError, match="sigma must be"):
            drifting_counts(2, 4, 8, 1, sigma=bad, steps=1)


def test_token_trace_uses_the_model() -> None:
    model = get_model("deepseek-v3")
    counts, ids = token_trace(model, 2, 64, drifting_popularity(256, sigma=1.0, steps=2))
    assert counts.shape == (2, 2, 256) and len(ids) == 2 and ids[0].shape == (2, 64, 8)
    g, _ = (ids[0].long() // 32).sort(2)
    assert int((1 + (g[..., 1:] != g[..., :-1]).sum(2)).max()) <= 4
    assert torch.equal(counts[1], token_counts(ids[1], 256))
