"""Router counts for the simulator: generated families, drifting traces, recorded files.

Legend: T steps, R ranks, E experts, S tokens per rank, K top-k;
``counts_TRE`` int64 ``[T, R, E]``.

Generated counts come from a drifting lognormal popularity (AR(1) with
correlation ``rho`` per step) routing every rank's ``S`` tokens, so EPLB's moving
average and moonplan's resident slots see step-to-step correlation; they are
exact top-k samples (``moonplan.traces``) on request, and by default a fast
multinomial whose probabilities approximate top-k inclusion (any EP size).
Skew is given as the lognormal ``sigma`` or as a MaxVio target, turned into a
sigma by :func:`sigma_for_maxvio`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from moonplan.traces.drift import drift_log_popularity, start_log_popularity
from moonplan.traces.files import load_counts
from moonplan.traces.generators import counts_for_ranks


def drifting_counts(
    ranks: int,
    experts: int,
    tokens: int,
    topk: int,
    *,
    sigma: float,
    steps: int,
    rho: float = 0.99,
    seed: int = 0,
    exact: bool = False,
) -> torch.Tensor:
    """``counts_TRE`` of ``steps`` steps under a drifting lognormal popularity.

    The log-popularity starts at ``sigma * z`` (``z ~ N(0, I)``, the first draw of a
    generator seeded ``seed``) and follows ``x <- rho*x + sqrt(1-rho^2)*sigma*eps``
    (the law of :mod:`moonplan.traces.drift`). Each step routes ``tokens`` tokens
    per rank by ``p = softmax(x)``:

    * ``exact=True``: ``moonplan.traces.counts_for_ranks`` (every token picks ``topk``
      distinct experts); slow for large ``R*S*K`` at high skew;
    * ``exact=False`` (default, fast at any size): each rank's ``S*K`` records are a
      multinomial draw with probabilities ``q/K``, where ``q_e = 1 - exp(-t p_e)``
      (``t`` such that ``sum q = K``) approximates the probability that a token
      picks expert ``e`` among its ``K`` distinct picks, the top-k cap included.
      Against exact sampling, ``q`` is off by about 1% of the records in total
      (L1; E = 8..896, K = 2..16, sigma <= 2); per-entry variance is ``S q (1 - q/K)``
      instead of ``S q (1 - q)``.
    """
    if steps < 1 or tokens < 0 or not 0 <= sigma or not -1 <= rho <= 1:
        raise ValueError("need steps >= 1, tokens >= 0, sigma >= 0 and rho in [-1, 1]")
    gen = torch.Generator().manual_seed(int(seed))
    rng = np.random.default_rng(int(seed))
    out = []
    for pop_E in popularity_walk(experts, sigma, steps, rho, gen):
        if exact:  # shares ``gen`` with the walk: it draws between two drifts
            out.append(counts_for_ranks(pop_E, [tokens] * ranks, topk, gen))
        else:
            q_E = inclusion_probability(pop_E, topk)
            draw = rng.multinomial(tokens * topk, (q_E / q_E.sum()).numpy(), size=ranks)
            out.append(torch.from_numpy(draw).to(torch.int64))
    return torch.stack(out)


def inclusion_probability(pop_E: torch.Tensor, topk: int) -> torch.Tensor:
    """float64 ``[E]``: ``q_e = 1 - exp(-t p_e)`` with ``sum q = K`` (bisection on ``t``):
    the Poisson approximation of the chance that a token's ``K`` distinct picks include
    ``e``. Needs at least ``K`` experts with ``p > 0``."""
    p_E = pop_E.to(torch.float64)
    if int((p_E > 0).sum()) < topk:
        raise ValueError(f"need at least topk = {topk} experts with positive popularity")
    if int((p_E > 0).sum()) == topk:
        return (p_E > 0).to(torch.float64)
    lo, hi = 0.0, 1.0
    while float((1 - torch.exp(-hi * p_E)).sum()) < topk:
        lo, hi = hi, hi * 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float((1 - torch.exp(-mid * p_E)).sum()) < topk else (lo, mid)
    return 1 - torch.exp(-hi * p_E)


def popularity_maxvio(sigma: float, experts: int, seed: int = 0) -> float:
    """MaxVio (``E * max p - 1``) of the first popularity ``softmax(sigma * z)`` that
    :func:`drifting_counts` draws with this ``seed`` (before top-k sampling)."""
    x_E = start_log_popularity(experts, sigma, torch.Generator().manual_seed(int(seed)))
    return float(torch.softmax(x_E, 0).max()) * experts - 1.0


def sigma_for_maxvio(target: float, experts: int, topk: int, seed: int = 0) -> float:
    """The lognormal sigma whose expected expert MaxVio is ``target`` (bisection on
    :func:`popularity_maxvio`, which grows with sigma for a fixed seed).

    Top-k sampling caps an expert's share of records at ``1/K``, so a target at or above
    ``E/K - 1`` cannot be reached; that raises ``ValueError``.
    """
    if not target >= 0:
        raise ValueError(f"MaxVio target must be >= 0, got {target}")
    cap = experts / topk - 1.0
    if target >= cap:
        raise ValueError(f"MaxVio {target} unreachable: top-{topk} caps it below E/K - 1 = {cap}")
    lo, hi = 0.0, 1.0
    while popularity_maxvio(hi, experts, seed) < target:
        lo, hi = hi, hi * 2
        if hi > 64:
            raise ValueError(f"MaxVio {target} unreachable with E = {experts}")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if popularity_maxvio(mid, experts, seed) < target else (lo, mid)
    return (lo + hi) / 2


def recorded_counts(path: str | Path) -> torch.Tensor:
    """``counts_TRE`` from a ``.npy``/``.json`` file (``[R, E]`` becomes one step)."""
    counts = load_counts(path)
    return counts[None] if counts.dim() == 2 else counts


def drifting_popularity(
    experts: int, *, sigma: float, steps: int, rho: float = 0.99, seed: int = 0
) -> Iterator[torch.Tensor]:
    """float64 ``[E]`` popularity of each step: the sequence :func:`drifting_counts` routes
    by with ``exact=False`` and the same ``seed`` (for token-level sampling,
    ``moonplan.simulate.token_routing``)."""
    if steps < 1 or sigma < 0 or abs(rho) > 1:
        raise ValueError("need steps >= 1, sigma >= 0 and rho in [-1, 1]")
    yield from popularity_walk(experts, sigma, steps, rho, torch.Generator().manual_seed(int(seed)))


def popularity_walk(
    experts: int, sigma: float, steps: int, rho: float, gen: torch.Generator
) -> Iterator[torch.Tensor]:
    """float64 ``[E]`` ``softmax(x)`` of each step of the drifting log-popularity ``x``
    (module :mod:`moonplan.traces.drift`), drawn from ``gen``: the start when the walk
    begins, each drift only when the next step is asked for, so a caller may draw from
    the same ``gen`` between steps (``drifting_counts(exact=True)`` does)."""
    x_E = start_log_popularity(experts, sigma, gen)
    for t in range(steps):
        if t:
            x_E = drift_log_popularity(x_E, sigma, rho, gen)
        yield torch.softmax(x_E, 0)
