"""Synthetic router counts: expert popularity, exact top-k sampling, counts per rank.

Used by the CLI, the benchmarks, the tests and the simulator to produce the
all-gathered router counts ``[R, E]`` a real MoE layer would see.

Legend:
    R ranks    E experts    S tokens (of one rank, or of a chunk)    K top-k
    pop_E     float64 popularity: the probability of each expert on one draw
    ids_SK    int64 expert ids picked by each token (``K`` distinct per token)
    counts_RE int64 records each source rank routes to each expert

Sampling model: every token draws ``K`` *distinct* experts, each draw from
``pop_E`` restricted to the experts not yet picked (sampling without
replacement, the Plackett-Luce law). That is exactly the law of Gumbel-top-k,
``argtopk(log pop_E + Gumbel noise)``. The default ``"sequential"`` method draws
it in ``O(S K)`` instead of ``O(S E)``: column ``k`` inverts the CDF of
``pop_E``; tokens whose pick repeats one of their earlier picks redraw from the
CDF with their picked experts cut out. Counts are therefore exact, not a
multinomial approximation: row ``s`` sums to ``S_s * K`` and no entry exceeds
``S_s``. Because each token picks an expert at most once, an expert's share of
the records is at most ``1/K`` however popular it is.

All randomness comes from an explicit ``torch.Generator`` (seeded from
``seed`` where a function takes one); nothing touches the global RNG, and the
same arguments give the same tensors. Everything is produced on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from moonplan.checks import check_int, check_range

FAMILIES = ("uniform", "lognormal", "zipf", "hot")
"""Popularity families understood by :func:`popularity`."""

COUNT_FAMILIES = (*FAMILIES, "zero")
"""Families understood by :func:`generate_counts` (``"zero"``: no records at all)."""

SAMPLE_METHODS = ("sequential", "gumbel")
"""Exact top-k samplers of :func:`sample_topk` (same law, different cost)."""

_CHUNK_RECORDS = 1 << 20  # ids sampled per chunk: bounds memory, fixes the RNG stream


# ---- popularity ---------------------------------------------------------------------------------


def popularity(
    family: str,
    num_experts: int,
    *,
    sigma: float = 1.0,
    zipf_s: float = 1.2,
    hot_share: float = 0.5,
    hot_expert: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Probability of each expert on one routing draw.

    Args:
        family: ``"uniform"``; ``"lognormal"`` (log-popularity normal with std
            ``sigma``); ``"zipf"`` (``p ~ rank**-zipf_s``, ranks randomly
            permuted over experts); ``"hot"`` (one expert gets ``hot_share`` of
            the probability, the others share the rest evenly).
        num_experts: ``E >= 1``.
        sigma: std of the log-popularity (``"lognormal"``), ``>= 0``.
        zipf_s: Zipf exponent (``"zipf"``), ``>= 0``.
        hot_share: probability of the hot expert on one draw (``"hot"``), in
            ``[0, 1]``; with top-k sampling its share of the records is at most ``1/K``.
        hot_expert: the hot expert's id (``"hot"``); ``None`` draws it.
        generator: source of randomness; ``None`` uses a fresh one seeded 0.

    Returns:
        pop_E: float64 ``[E]``, non-negative, summing to 1 (CPU).
    """
    E = check_int("num_experts", num_experts, 1)
    gen = generator if generator is not None else make_generator(0)
    if family == "uniform":
        return torch.full((E,), 1.0 / E, dtype=torch.float64)
    if family == "lognormal":
        check_range("sigma", sigma, 0.0, math.inf)
        z_E = torch.randn(E, generator=gen, dtype=torch.float64)
        return torch.softmax(sigma * z_E, dim=0)
    if family == "zipf":
        check_range("zipf_s", zipf_s, 0.0, math.inf)
        rank_E = torch.randperm(E, generator=gen).to(torch.float64) + 1.0
        w_E = rank_E.pow(-zipf_s)
        return w_E / w_E.sum()
    if family == "hot":
        return hot_popularity(E, hot_share, hot_expert, gen)
    raise ValueError(f"unknown popularity family {family!r}; choose one of {FAMILIES}")


def hot_popularity(
    E: int, hot_share: float, hot_expert: int | None, gen: torch.Generator
) -> torch.Tensor:
    check_range("hot_share", hot_share, 0.0, 1.0)
    if hot_expert is None:
        hot_expert = int(torch.randint(E, (1,), generator=gen))
    if not 0 <= hot_expert < E:
        raise ValueError(f"hot_expert must be in [0, {E}), got {hot_expert}")
    if E == 1:
        return torch.ones(1, dtype=torch.float64)
    pop_E = torch.full((E,), (1.0 - hot_share) / (E - 1), dtype=torch.float64)
    pop_E[hot_expert] = hot_share
    return pop_E


# ---- top-k sampling ----------------------------------------------------------------------------


def sample_topk(
    popularity_E: torch.Tensor,
    tokens: int,
    topk: int,
    generator: torch.Generator | None = None,
    *,
    method: str = "sequential",
) -> torch.Tensor:
    """Each of ``tokens`` tokens picks ``topk`` distinct experts following a popularity.

    Args:
        popularity_E: ``[E]`` non-negative weights (need not sum to 1); at least
            ``topk`` of them must be positive.
        tokens: ``S >= 0``.
        topk: ``K``, ``1 <= K <= E``.
        generator: source of randomness; ``None`` uses a fresh one seeded 0.
        method: ``"sequential"`` (``O(S K)``, the default) or ``"gumbel"``
            (``argtopk`` of ``log p`` plus Gumbel noise, ``O(S E)``). Both draw
            the same law (see the module docstring), not the same numbers.
            Tokens are drawn in chunks, so memory stays bounded for any ``S``.

    Returns:
        ids_SK: int64 ``[S, K]``; the ``K`` ids of a row are distinct, in draw
        order (most "preferred" first).

    Raises:
        ValueError: bad popularity, ``topk`` out of range, or unknown ``method``.
    """
    pop_E = _check_popularity(popularity_E, topk)
    S = check_int("tokens", tokens, 0)
    gen = generator if generator is not None else make_generator(0)
    if method not in SAMPLE_METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {SAMPLE_METHODS}")
    draw = _draw_sequential if method == "sequential" else _draw_gumbel
    chunk = max(1, _CHUNK_RECORDS // (topk if method == "sequential" else pop_E.numel()))
    out = [draw(pop_E, min(chunk, S - s0), topk, gen) for s0 in range(0, S, chunk)]
    return torch.cat(out) if out else torch.empty(0, topk, dtype=torch.int64)


def counts_from_topk(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Records routed to each expert by the picks ``topk_ids``.

    Args:
        topk_ids: integer ``[S, K]`` expert ids in ``[0, E)``.
        num_experts: ``E``.

    Returns:
        counts_E: int64 ``[E]`` (``bincount``).
    """
    E = check_int("num_experts", num_experts, 1)
    if topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        got = f"{topk_ids.dtype}{tuple(topk_ids.shape)}"
        raise ValueError(f"topk_ids must be an integer [S, K] tensor, got {got}")
    ids = topk_ids.reshape(-1).to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
        raise ValueError(
            f"topk_ids must lie in [0, {E}), got range [{int(ids.min())}, {int(ids.max())}]"
        )
    return torch.bincount(ids, minlength=E)


def _check_popularity(popularity_E: torch.Tensor, topk: int) -> torch.Tensor:
    pop_E = torch.as_tensor(popularity_E, dtype=torch.float64).cpu()
    if pop_E.dim() != 1 or pop_E.numel() < 1:
        raise ValueError(
            f"popularity must be a non-empty 1-D tensor [E], got shape {tuple(pop_E.shape)}"
        )
    if not bool(torch.isfinite(pop_E).all()) or bool((pop_E < 0).any()):
        raise ValueError("popularity must be finite and non-negative")
    E = pop_E.numel()
    K = check_int("topk", topk, 1)
    if K > E:
        raise ValueError(
            f"topk = {K} exceeds the number of experts E = {E}: a token picks distinct experts"
        )
    positive = int((pop_E > 0).sum())
    if positive < K:
        raise ValueError(f"only {positive} experts have positive popularity; topk = {K} needs more")
    return pop_E / pop_E.sum()


def _draw_gumbel(pop_E: torch.Tensor, S: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """``[S, K]`` ids: argtopk of ``log p + Gumbel`` (``-log`` of Exp(1) noise is Gumbel)."""
    noise_SE = torch.empty(S, pop_E.numel(), dtype=torch.float64).exponential_(generator=gen)
    return (pop_E.log() - noise_SE.log()).topk(K, dim=1).indices


def _draw_sequential(pop_E: torch.Tensor, S: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """``[S, K]`` ids drawn column by column without replacement (see module docstring)."""
    cdf_E = pop_E.cumsum(0)
    cdf_E = cdf_E / cdf_E[-1]
    ids_SK = torch.empty(S, K, dtype=torch.int64)
    for k in range(K):
        u_S = torch.rand(S, generator=gen, dtype=torch.float64)
        ids_SK[:, k] = torch.searchsorted(cdf_E, u_S, right=True).clamp_(max=cdf_E.numel() - 1)
        redo = (ids_SK[:, :k] == ids_SK[:, k : k + 1]).any(1).nonzero().squeeze(1)
        if redo.numel():
            ids_SK[redo, k] = _draw_excluding(pop_E, cdf_E, ids_SK[redo, :k], gen)
    return ids_SK


def _draw_excluding(
    pop_E: torch.Tensor, cdf_E: torch.Tensor, taken_NJ: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """One draw per row from ``pop_E`` restricted to the experts not in that row of ``taken_NJ``.

    Inverts the CDF with the taken experts' intervals cut out: a uniform ``u`` on
    the free mass lands at ``u`` plus the mass of the taken intervals before it.
    With the taken ids sorted, taken interval ``j`` lies before the landing point
    iff ``u >= start_j - mass of taken intervals before j`` (non-decreasing in j).
    Rows that rounding still sends onto a taken or empty expert get a masked
    Gumbel-max draw instead (same law).
    """
    start_E = torch.cat([cdf_E.new_zeros(1), cdf_E[:-1]])
    taken_NJ = taken_NJ.sort(1).values
    start_NJ = start_E[taken_NJ]
    mass_NJ = cdf_E[taken_NJ] - start_NJ
    upto_NJ = mass_NJ.cumsum(1)  # taken mass up to and including interval j
    thresh_NJ = start_NJ - (upto_NJ - mass_NJ)
    u_N = torch.rand(taken_NJ.shape[0], generator=gen, dtype=torch.float64) * (1 - upto_NJ[:, -1])
    n_N = (thresh_NJ <= u_N[:, None]).sum(1, keepdim=True)  # taken intervals before the landing
    shift_N = upto_NJ.gather(1, (n_N - 1).clamp(min=0)).squeeze(1) * (n_N.squeeze(1) > 0)
    pick_N = torch.searchsorted(cdf_E, u_N + shift_N, right=True).clamp_(max=cdf_E.numel() - 1)
    bad = ((taken_NJ == pick_N[:, None]).any(1) | (pop_E[pick_N] == 0)).nonzero().squeeze(1)
    if bad.numel():
        pick_N[bad] = _masked_gumbel_max(pop_E, taken_NJ[bad], gen)
    return pick_N


def _masked_gumbel_max(
    pop_E: torch.Tensor, taken_SJ: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """One draw per row from ``pop_E`` restricted to experts not in ``taken_SJ`` row."""
    logp_SE = pop_E.log().expand(taken_SJ.shape[0], -1).clone()
    logp_SE.scatter_(1, taken_SJ, -math.inf)
    noise_SE = torch.empty_like(logp_SE).exponential_(generator=gen)
    return (logp_SE - noise_SE.log()).argmax(1)


# ---- counts -------------------------------------------------------------------------------------


def generate_counts(
    family: str,
    *,
    ranks: int,
    experts: int,
    tokens: int | Sequence[int],
    topk: int,
    seed: int = 0,
    sigma: float = 1.0,
    zipf_s: float = 1.2,
    hot_share: float = 0.5,
    hot_expert: int | None = None,
    empty_ranks: int = 0,
) -> torch.Tensor:
    """Router counts of one step: every rank routes its tokens by the same popularity.

    Sampling is exact (see the module docstring): row ``s`` sums to
    ``tokens[s] * topk`` and every entry is at most ``tokens[s]``.

    Args:
        family: one of :data:`COUNT_FAMILIES` (``"zero"``: all counts 0).
        ranks: ``R >= 1``.
        experts: ``E >= 1``.
        tokens: ``S`` per rank: one int for all ranks or a list of ``R`` ints.
        topk: ``K``, ``1 <= K <= E``.
        seed: seeds the popularity and the sampling.
        sigma, zipf_s, hot_share, hot_expert: see :func:`popularity`.
        empty_ranks: the last ``empty_ranks`` ranks get no tokens.

    Returns:
        counts_RE: int64 ``[R, E]`` (CPU).
    """
    R = check_int("ranks", ranks, 1)
    E = check_int("experts", experts, 1)
    S_R = tokens_per_rank(tokens, R, empty_ranks)
    if family == "zero":
        check_int("topk", topk, 1)
        return torch.zeros(R, E, dtype=torch.int64)
    if family not in FAMILIES:
        raise ValueError(f"unknown counts family {family!r}; choose one of {COUNT_FAMILIES}")
    gen = make_generator(seed)
    pop_E = popularity(
        family,
        E,
        sigma=sigma,
        zipf_s=zipf_s,
        hot_share=hot_share,
        hot_expert=hot_expert,
        generator=gen,
    )
    return counts_for_ranks(pop_E, S_R, topk, gen)


def counts_for_ranks(
    popularity_E: torch.Tensor, tokens_R: Sequence[int], topk: int, generator: torch.Generator
) -> torch.Tensor:
    """Counts ``[R, E]`` when rank ``s`` routes ``tokens_R[s]`` tokens by ``popularity_E``.

    Tokens of all ranks are drawn in one stream (they are i.i.d.), in chunks.

    Returns:
        counts_RE: int64 ``[R, E]``; row ``s`` sums to ``tokens_R[s] * topk``.
    """
    pop_E = _check_popularity(popularity_E, topk)
    E, R = pop_E.numel(), len(tokens_R)
    S_R = torch.tensor(list(tokens_R), dtype=torch.int64)
    rank_T = torch.repeat_interleave(torch.arange(R), S_R)  # source rank of every token
    flat = torch.zeros(R * E, dtype=torch.int64)
    chunk = max(1, _CHUNK_RECORDS // topk)
    for t0 in range(0, rank_T.numel(), chunk):
        rank_C = rank_T[t0 : t0 + chunk]
        ids_CK = _draw_sequential(pop_E, rank_C.numel(), topk, generator)
        flat += torch.bincount((rank_C[:, None] * E + ids_CK).reshape(-1), minlength=R * E)
    return flat.reshape(R, E)


def tokens_per_rank(tokens: int | Sequence[int], R: int, empty_ranks: int) -> list[int]:
    if isinstance(tokens, (int, np.integer)):
        S_R = [check_int("tokens", tokens, 0)] * R
    else:
        S_R = [check_int("tokens[i]", s, 0) for s in tokens]
        if len(S_R) != R:
            raise ValueError(f"tokens has {len(S_R)} entries, expected one per rank ({R})")
    n_empty = check_int("empty_ranks", empty_ranks, 0)
    if n_empty > R:
        raise ValueError(f"empty_ranks = {n_empty} exceeds ranks = {R}")
    return S_R[: R - n_empty] + [0] * n_empty


# ---- small helpers ------------------------------------------------------------------------------


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))
