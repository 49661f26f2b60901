"""``moonplan.traces.generators``: popularity, exact top-k sampling and counts.

Legend: R ranks, E experts, S tokens, K top-k, T steps.
"""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch

from moonplan import traces
from moonplan.traces import (
    COUNT_FAMILIES,
    FAMILIES,
    counts_from_topk,
    generate_counts,
    generators,
    popularity,
    sample_topk,
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_distinct_rows(ids_SK: torch.Tensor) -> None:
    if ids_SK.shape[1] > 1:
        assert bool((ids_SK.sort(1).values.diff(dim=1) > 0).all())


# ---- popularity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("E", [1, 2, 7, 64])
def test_popularity_is_a_distribution(family: str, E: int) -> None:
    pop_E = popularity(family, E, generator=gen())
    assert pop_E.shape == (E,) and pop_E.dtype == torch.float64
    assert bool((pop_E >= 0).all())
    assert math.isclose(float(pop_E.sum()), 1.0, rel_tol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_popularity_is_deterministic_by_generator(family: str) -> None:
    assert torch.equal(
        popularity(family, 32, generator=gen(3)), popularity(family, 32, generator=gen(3))
    )
    assert torch.equal(popularity(family, 32), popularity(family, 32))  # None: seeded 0


def test_popularity_families_have_their_shape() -> None:
    assert torch.equal(popularity("lognormal", 16, sigma=0.0), popularity("uniform", 16))
    log_pop = popularity("lognormal", 4096, sigma=2.0, generator=gen()).log()
    assert 1.9 < float(log_pop.std()) < 2.1
    zipf = popularity("zipf", 50, zipf_s=1.5, generator=gen()).sort(descending=True).values
    ratio = zipf[0] / zipf
    assert torch.allclose(ratio, torch.arange(1, 51, dtype=torch.float64) ** 1.5)
    hot = popularity("hot", 10, hot_share=0.7, hot_expert=3)
    assert float(hot[3]) == pytest.approx(0.7) and float(hot[0]) == pytest.approx(0.3 / 9)


def test_popularity_errors() -> None:
    with pytest.raises(ValueError, match="unknown popularity family"):
        popularity("zero", 4)
    with pytest.raises(ValueError, match="sigma"):
        popularity("lognormal", 4, sigma=-1.0)
    with pytest.raises(ValueError, match="hot_share"):
        popularity("hot", 4, hot_share=1.5)
    with pytest.raises(ValueError, match="hot_expert"):
        popularity("hot", 4, hot_expert=4)
    with pytest.raises(ValueError, match="num_experts"):
        popularity("uniform", 0)


# ---- sample_topk --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", traces.SAMPLE_METHODS)
@pytest.mark.parametrize("family", FAMILIES)
def test_sample_topk_shape_range_distinct(method: str, family: str) -> None:
    pop_E = popularity(family, 40, sigma=3.0, hot_share=0.9, generator=gen())
    ids_SK = sample_topk(pop_E, 500, 8, gen(1), method=method)
    assert ids_SK.shape == (500, 8) and ids_SK.dtype == torch.int64
    assert int(ids_SK.min()) >= 0 and int(ids_SK.max()) < 40
    assert_distinct_rows(ids_SK)


def test_sample_topk_edge_sizes() -> None:
    pop_E = popularity("zipf", 6, generator=gen())
    full = sample_topk(pop_E, 50, 6, gen())  # K == E: every row is a permutation
    assert torch.equal(full.sort(1).values, torch.arange(6).expand(50, 6))
    assert sample_topk(pop_E, 0, 3, gen()).shape == (0, 3)
    sparse_E = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0])  # unnormalised, zeros never picked
    ids = sample_topk(sparse_E, 300, 3, gen())
    assert set(ids.unique().tolist()) == {1, 3, 4}


def test_sample_topk_is_deterministic_and_seed_dependent() -> None:
    pop_E = popularity("lognormal", 64, generator=gen())
    assert torch.equal(sample_topk(pop_E, 200, 4, gen(5)), sample_topk(pop_E, 200, 4, gen(5)))
    assert not torch.equal(sample_topk(pop_E, 200, 4, gen(5)), sample_topk(pop_E, 200, 4, gen(6)))


def test_sample_topk_errors() -> None:
    pop_E = popularity("uniform", 4)
    with pytest.raises(ValueError, match="exceeds the number of experts"):
        sample_topk(pop_E, 10, 5, gen())
    with pytest.raises(ValueError, match="topk"):
        sample_topk(pop_E, 10, 0, gen())
    with pytest.raises(ValueError, match="positive popularity"):
        sample_topk(torch.tensor([1.0, 0.0, 0.0]), 10, 2, gen())
    with pytest.raises(ValueError, match="non-negative"):
        sample_topk(torch.tensor([1.0, -1.0]), 10, 1, gen())
    with pytest.raises(ValueError, match="1-D"):
        sample_topk(torch.ones(2, 2), 10, 1, gen())
    with pytest.raises(ValueError, match="method"):
        sample_topk(pop_E, 10, 1, gen(), method="multinomial")


def plackett_luce(p: list[float], order: tuple[int, ...]) -> float:
    """Probability of drawing ``order`` first, without replacement, from ``p``."""
    prob, left = 1.0, 1.0
    for e in order:
        prob *= p[e] / left
        left -= p[e]
    return prob


@pytest.mark.parametrize("method", traces.SAMPLE_METHODS)
def test_sample_topk_follows_the_plackett_luce_law(method: str) -> None:
    """Ordered triples from a skewed popularity match the exact law (5 sigma, fixed seed)."""
    p = [0.45, 0.25, 0.15, 0.1, 0.05]
    S = 60_000
    ids_SK = sample_topk(torch.tensor(p), S, 3, gen(11), method=method)
    key_S = (ids_SK * torch.tensor([25, 5, 1])).sum(1)
    freq = torch.bincount(key_S, minlength=125).double() / S
    for order in itertools.permutations(range(5), 3):
        want = plackett_luce(p, order)
        got = float(freq[order[0] * 25 + order[1] * 5 + order[2]])
        assert abs(got - want) <= 5 * math.sqrt(want * (1 - want) / S), (order, got, want)


def test_masked_gumbel_fallback_follows_the_law() -> None:
    p = torch.tensor([0.5, 0.3, 0.2])
    taken = torch.zeros(40_000, 1, dtype=torch.int64)  # expert 0 taken: 1 vs 2 is 0.6 : 0.4
    picks = generators._masked_gumbel_max(p, taken, gen())
    assert int((picks == 0).sum()) == 0
    assert abs(float((picks == 1).double().mean()) - 0.6) < 0.01


def test_counts_from_topk() -> None:
    ids_SK = torch.tensor([[0, 2], [2, 1], [2, 0]])
    assert counts_from_topk(ids_SK, 4).tolist() == [2, 1, 3, 0]
    assert counts_from_topk(torch.empty(0, 2, dtype=torch.int64), 3).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        counts_from_topk(ids_SK, 2)
    with pytest.raises(ValueError, match="integer"):
        counts_from_topk(ids_SK.double(), 4)


# ---- generate_counts ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_counts_sums_and_caps(family: str) -> None:
    counts_RE = generate_counts(
        family, ranks=5, experts=12, tokens=[30, 0, 7, 64, 1], topk=4, sigma=2.0, hot_share=0.9
    )
    assert counts_RE.shape == (5, 12) and counts_RE.dtype == torch.int64
    tokens_R = torch.tensor([30, 0, 7, 64, 1])
    assert torch.equal(counts_RE.sum(1), tokens_R * 4)
    assert bool((counts_RE <= tokens_R[:, None]).all())  # distinct experts per token


def test_generate_counts_hot_expert_is_capped_by_distinctness() -> None:
    counts_RE = generate_counts("hot", ranks=3, experts=8, tokens=100, topk=2, hot_share=0.9)
    assert int(counts_RE.sum(0).max()) == 300  # every token picks the hot expert, once


def test_generate_counts_empty_ranks_and_zero() -> None:
    counts_RE = generate_counts("zipf", ranks=6, experts=5, tokens=10, topk=2, empty_ranks=2)
    assert counts_RE.sum(1).tolist() == [20, 20, 20, 20, 0, 0]
    zero = generate_counts("zero", ranks=3, experts=4, tokens=10, topk=2)
    assert torch.equal(zero, torch.zeros(3, 4, dtype=torch.int64))


def test_generate_counts_is_deterministic_by_seed() -> None:
    kw = dict(ranks=4, experts=16, tokens=50, topk=2)
    assert torch.equal(generate_counts("lognormal", **kw), generate_counts("lognormal", **kw))
    assert not torch.equal(
        generate_counts("lognormal", seed=1, **kw), generate_counts("lognormal", **kw)
    )


def test_generate_counts_errors() -> None:
    with pytest.raises(ValueError, match="unknown counts family"):
        generate_counts("bimodal", ranks=2, experts=4, tokens=8, topk=2)
    with pytest.raises(ValueError, match="exceeds the number of experts"):
        generate_counts("uniform", ranks=2, experts=4, tokens=8, topk=5)
    with pytest.raises(ValueError, match="one per rank"):
        generate_counts("uniform", ranks=2, experts=4, tokens=[8], topk=2)
    with pytest.raises(ValueError, match="empty_ranks"):
        generate_counts("uniform", ranks=2, experts=4, tokens=8, topk=2, empty_ranks=3)
    with pytest.raises(ValueError, match="tokens"):
        generate_counts("uniform", ranks=2, experts=4, tokens=-1, topk=2)


def test_sample_topk_big_case_is_fast() -> None:
    pop_E = popularity("lognormal", 896, generator=gen())
    start = time.process_time()  # CPU time: robust to a loaded machine
    ids_SK = sample_topk(pop_E, 8192, 16, gen())
    assert time.process_time() - start < 5.0  # ~0.05 s of CPU; generous
    assert ids_SK.shape == (8192, 16)
    assert_distinct_rows(ids_SK)


@pytest.mark.slow
def test_generate_counts_big_case_is_fast() -> None:
    start = time.process_time()  # CPU time: robust to a loaded machine
    counts_RE = generate_counts("lognormal", ranks=256, experts=896, tokens=8192, topk=16)
    assert time.process_time() - start < 60.0  # ~3-8 s of CPU; generous
    assert bool((counts_RE.sum(1) == 8192 * 16).all()) and int(counts_RE.max()) <= 8192


def test_count_families_include_zero() -> None:
    assert set(COUNT_FAMILIES) == {*FAMILIES, "zero"}
