"""Router counts for the simulator: generated families, drifting traces, recorded files.

Legend: T steps, R ranks, E experts, S tokens per rank, K top-k, N steps before a trace;
``counts_TRE`` int64 ``[T, R, E]``; ``totals_NE`` int64 ``[N, E]``.

Generated counts come from a lognormal popularity with a persistent and a drifting part
(``moonplan.traces.drift``: log-popularity ``mu_e + x_t[e]``, ``mu`` fixed per trace, ``x``
AR(1) with correlation ``rho`` per step; ``persistent`` is the share of the variance in
``mu``, by default :data:`~moonplan.traces.persistence.PERSISTENT_SHARE`, measured on real
routing; ``persistent=0`` is the earlier model) routing every rank's ``S`` tokens, so
EPLB's moving average and moonplan's resident slots see step-to-step correlation; they
are exact top-k samples (``moonplan.traces``) on request, and by default a fast
multinomial whose probabilities approximate top-k inclusion (any EP size). Skew is given
as the lognormal ``sigma`` (the total spread) or as a MaxVio target, turned into a sigma
by :func:`sigma_for_maxvio`. :func:`prehistory` draws the per-expert totals of steps
*before* a trace, for the long window of the deployed EPLB.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from moonplan.baselines.prehistory import Prehistory
from moonplan.traces.drift import (
    DriftLaw,
    drift_log_popularity,
    jump_log_popularity,
    start_log_popularity,
)
from moonplan.traces.files import load_counts
from moonplan.traces.generators import counts_for_ranks, make_generator
from moonplan.traces.persistence import PERSISTENT_SHARE


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
    persistent: float = PERSISTENT_SHARE,
) -> torch.Tensor:
    """``counts_TRE`` of ``steps`` steps under a lognormal popularity, persistent and drifting.

    The log-popularity is ``mu + x`` (the law of :mod:`moonplan.traces.drift`): ``mu`` fixed
    (std ``sigma_p``, its own generator), ``x`` starting at ``sigma_f * z`` (``z ~ N(0, I)``,
    the first draw of a generator seeded ``seed``) and following
    ``x <- rho*x + sqrt(1-rho^2)*sigma_f*eps``, where ``sigma_p**2 = persistent * sigma**2``
    and ``sigma_f**2 = (1 - persistent) * sigma**2``. Each step routes ``tokens`` tokens per
    rank by ``p = softmax(mu + x)``:

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
    if tokens < 0:
        raise ValueError(f"need tokens >= 0, got {tokens}")
    law = DriftLaw(sigma=sigma, rho=rho, seed=seed, persistent=persistent)
    gen, walk = _seeded_walk(experts, steps, law)
    rng = np.random.default_rng(int(seed))
    out = []
    for pop_E in walk:
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


def popularity_maxvio(
    sigma: float, experts: int, seed: int = 0, persistent: float = PERSISTENT_SHARE
) -> float:
    """MaxVio (``E * max p - 1``) of the first popularity ``softmax(mu + x_0)`` that
    :func:`drifting_counts` draws with this ``seed`` and ``persistent`` share (before top-k
    sampling)."""
    law = DriftLaw(sigma=sigma, seed=seed, persistent=persistent)
    first_E = law.persistent_part(experts) + law.start(experts)
    return float(torch.softmax(first_E, 0).max()) * experts - 1.0


def sigma_for_maxvio(
    target: float, experts: int, topk: int, seed: int = 0, persistent: float = PERSISTENT_SHARE
) -> float:
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
    while popularity_maxvio(hi, experts, seed, persistent) < target:
        lo, hi = hi, hi * 2
        if hi > 64:
            raise ValueError(f"MaxVio {target} unreachable with E = {experts}")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (
            (mid, hi) if popularity_maxvio(mid, experts, seed, persistent) < target else (lo, mid)
        )
    return (lo + hi) / 2


def recorded_counts(path: str | Path) -> torch.Tensor:
    """``counts_TRE`` from a ``.npy``/``.json`` file (``[R, E]`` becomes one step)."""
    counts = load_counts(path)
    return counts[None] if counts.dim() == 2 else counts


def drifting_popularity(
    experts: int,
    *,
    sigma: float,
    steps: int,
    rho: float = 0.99,
    seed: int = 0,
    persistent: float = PERSISTENT_SHARE,
) -> Iterator[torch.Tensor]:
    """float64 ``[E]`` popularity of each step: the sequence :func:`drifting_counts` routes
    by with ``exact=False`` and the same ``seed`` and ``persistent`` (for token-level
    sampling, ``moonplan.simulate.token_routing``)."""
    law = DriftLaw(sigma=sigma, rho=rho, seed=seed, persistent=persistent)
    yield from _seeded_walk(experts, steps, law)[1]


def _seeded_walk(
    experts: int, steps: int, law: DriftLaw
) -> tuple[torch.Generator, Iterator[torch.Tensor]]:
    """The generator seeded ``law.seed`` and the :func:`popularity_walk` of ``steps`` steps
    drawn from it, the law's persistent part ``mu`` included: the popularity of
    :func:`drifting_counts` and :func:`drifting_popularity` (``ValueError`` if
    ``steps < 1``)."""
    if steps < 1:
        raise ValueError(f"need steps >= 1, got {steps}")
    gen = make_generator(law.seed)
    mu_E = law.persistent_part(experts)
    return gen, popularity_walk(experts, law.sigma_f, steps, law.rho, gen, mu_E)


def popularity_walk(
    experts: int,
    sigma: float,
    steps: int,
    rho: float,
    gen: torch.Generator,
    mu_E: torch.Tensor | None = None,
) -> Iterator[torch.Tensor]:
    """float64 ``[E]`` ``softmax(mu + x)`` of each step of the drifting log-popularity ``x``
    of stationary std ``sigma`` (module :mod:`moonplan.traces.drift`; ``mu_E``: the
    persistent part, ``None``: none), drawn from ``gen``: the start when the walk begins,
    each drift only when the next step is asked for, so a caller may draw from the same
    ``gen`` between steps (``drifting_counts(exact=True)`` does)."""
    x_E = start_log_popularity(experts, sigma, gen)
    for t in range(steps):
        if t:
            x_E = drift_log_popularity(x_E, sigma, rho, gen)
        yield torch.softmax(x_E if mu_E is None else mu_E + x_E, 0)


PREHISTORY_SEED_OFFSET = 1 << 61
"""The steps before a trace of seed ``s`` are drawn from generators seeded
``s + PREHISTORY_SEED_OFFSET`` (their own streams: the trace does not change)."""


def prehistory(
    steps_N: torch.Tensor,
    *,
    ranks: int,
    experts: int,
    tokens: int,
    topk: int,
    sigma: float,
    rho: float = 0.99,
    seed: int = 0,
    persistent: float = PERSISTENT_SHARE,
) -> Prehistory:
    """The per-expert totals of the steps ``steps_N`` (int64 ``[N]``, negative) before the
    trace :func:`drifting_counts` draws with the same arguments.

    The walk ``x`` is drawn *backwards*, one step at a time, from the trace's first ``x_0``
    to the earliest step asked for (the AR(1) process is reversible: ``x`` one step earlier
    has the law of one step later); ``mu`` is the trace's. Each step's ``R * S * K`` records
    are one multinomial draw with the fast sampler's probabilities
    (:func:`inclusion_probability`), the law of the fast trace's totals over ranks, drawn
    in the walk's order (step -1 first). So a step's totals depend on the law and the step
    alone, not on the other steps asked for: a policy primed with them sees the same past
    whichever policies share the run. Deterministic; the trace's own draws are not touched.
    """
    steps = sorted(int(t) for t in steps_N.tolist())
    if any(t >= 0 for t in steps) or len(set(steps)) != len(steps):
        raise ValueError("prehistory steps must be distinct and negative")
    if not steps:
        return Prehistory(
            torch.zeros(0, dtype=torch.int64), torch.zeros(0, experts, dtype=torch.int64)
        )
    law = DriftLaw(sigma=sigma, rho=rho, seed=seed, persistent=persistent)
    mu_E, x_E = law.persistent_part(experts), law.start(experts)
    gen = make_generator(int(seed) + PREHISTORY_SEED_OFFSET)
    logp = []  # row k: step -(k + 1)
    for _ in range(-steps[0]):
        x_E = jump_log_popularity(x_E, law.sigma_f, law.rho, 1, gen)
        logp.append(mu_E + x_E)
    q_WE = inclusion_probability_rows(torch.softmax(torch.stack(logp), dim=1), topk)
    rng = np.random.default_rng(int(seed) + PREHISTORY_SEED_OFFSET)
    walk_WE = rng.multinomial(ranks * tokens * topk, (q_WE / q_WE.sum(1, keepdim=True)).numpy())
    totals = walk_WE[[-t - 1 for t in steps]]
    return Prehistory(
        torch.tensor(steps, dtype=torch.int64), torch.from_numpy(totals).to(torch.int64)
    )


def inclusion_probability_rows(pop_NE: torch.Tensor, topk: int) -> torch.Tensor:
    """:func:`inclusion_probability` of every row of ``pop_NE`` (float64 ``[N, E]``) at once.

    The same ``q = 1 - exp(-t p)`` with ``sum q = K``, ``t`` found by Newton's method from
    ``t = K`` (where ``sum q <= K``): ``sum q`` is concave and increasing in ``t``, so every
    iterate stays at or below the root and the steps shrink to it (about 10 iterations
    instead of the bisection's 100; the two agree to about ``1e-12``).
    """
    p_NE = pop_NE.to(torch.float64).numpy()
    positive_N = (p_NE > 0).sum(1, keepdims=True)
    if bool((positive_N < topk).any()):
        raise ValueError(f"need at least topk = {topk} experts with positive popularity")
    exact_N = positive_N == topk  # every positive expert is picked by every token
    t_N = np.full((p_NE.shape[0], 1), float(topk))
    for _ in range(200):
        e_NE = np.exp(-t_N * p_NE)
        gap_N = topk - (1 - e_NE).sum(1, keepdims=True)
        slope_N = (p_NE * e_NE).sum(1, keepdims=True)
        step_N = np.where(exact_N | (slope_N <= 0), 0.0, gap_N / np.maximum(slope_N, 1e-300))
        t_N = t_N + np.maximum(step_N, 0.0)
        if bool((step_N <= 1e-15 * t_N).all()):
            break
    q_NE = np.where(exact_N, (p_NE > 0).astype(np.float64), -np.expm1(-t_N * p_NE))
    return torch.from_numpy(q_NE)
