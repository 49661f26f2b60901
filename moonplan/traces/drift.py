"""Router counts over steps: the AR(1) drift law of log-popularity, and the step traces.

The drift law is written once, here: :func:`start_log_popularity` draws the stationary
start and :func:`drift_log_popularity` takes one step. :class:`DriftingTrace`, the
simulator's ``simulate.workload.drifting_counts`` and the CLI demo's router bias all
call these two functions, so the same seed gives the same popularities everywhere.

Legend:
    R ranks    E experts    K top-k    T steps of a trace
    x_E       float log-popularity of each expert (``softmax(x_E)`` is ``pop_E``)
    eps_E     float standard normal innovation of one step
    counts_RE int64 records each source rank routes to each expert
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import KW_ONLY, dataclass

import torch

from moonplan.checks import check_int, check_range
from moonplan.traces.generators import (
    counts_for_ranks,
    hot_popularity,
    make_generator,
    tokens_per_rank,
)

# ---- the drift law ------------------------------------------------------------------------------


def start_log_popularity(
    experts: int, sigma: float, gen: torch.Generator, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """x_E of step 0: ``sigma * z`` with ``z ~ N(0, I)`` drawn from ``gen``.

    This is the stationary law ``N(0, sigma**2)`` of :func:`drift_log_popularity`.

    Returns:
        ``dtype`` ``[experts]`` (float64 by default).
    """
    return sigma * torch.randn(experts, generator=gen, dtype=dtype)


def drift_log_popularity(
    x_E: torch.Tensor, sigma: float, rho: float, gen: torch.Generator
) -> torch.Tensor:
    """x_E of the next step: ``rho * x + sqrt(1 - rho**2) * sigma * eps``, ``eps ~ N(0, I)``.

    ``eps_E`` is drawn from ``gen`` in the dtype of ``x_E``; ``rho`` near 1 drifts
    slowly, ``rho = 0`` draws independent steps, and the law ``N(0, sigma**2)`` is kept.

    Returns:
        a new tensor, same shape and dtype as ``x_E``.
    """
    eps_E = torch.randn(x_E.shape[0], generator=gen, dtype=x_E.dtype)
    innovation = math.sqrt(max(0.0, 1.0 - rho * rho)) * sigma
    return rho * x_E + innovation * eps_E


# ---- traces over steps --------------------------------------------------------------------------


@dataclass(eq=False, repr=False)
class StepTrace:
    """Shared plumbing of the step-by-step traces: sizes, ``steps`` and iteration.

    ``StepTrace(ranks, experts, tokens, topk, *, seed=0)``; a subclass adds its own
    keyword-only parameters as dataclass fields after a ``KW_ONLY`` marker and checks
    them in ``__post_init__`` (after calling this one, which draws nothing).
    """

    ranks: int
    experts: int
    tokens: int | Sequence[int]
    topk: int
    _: KW_ONLY
    seed: int = 0

    def __post_init__(self) -> None:
        self.num_experts = check_int("experts", self.experts, 1)
        self.tokens_R = tokens_per_rank(self.tokens, check_int("ranks", self.ranks, 1), 0)
        self.topk = check_int("topk", self.topk, 1)
        if self.topk > self.num_experts:
            raise ValueError(f"topk = {self.topk} exceeds the number of experts E = {self.experts}")
        self._gen = make_generator(self.seed)

    def step(self) -> torch.Tensor:
        """Counts of the current step (int64 ``[R, E]``), then advance one step."""
        raise NotImplementedError

    def steps(self, num_steps: int) -> torch.Tensor:
        """The next ``num_steps`` steps: int64 ``[T, R, E]``."""
        T = check_int("num_steps", num_steps, 0)
        if T == 0:
            return torch.zeros(0, len(self.tokens_R), self.num_experts, dtype=torch.int64)
        return torch.stack([self.step() for _ in range(T)])

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        return self.step()


@dataclass(eq=False, repr=False)
class DriftingTrace(StepTrace):
    """Counts per step whose log-popularity drifts as an AR(1) process.

    ``x_{t+1} = rho * x_t + sqrt(1 - rho**2) * sigma * eps_t`` with ``eps_t ~ N(0, I)``
    per expert, started from the stationary law ``N(0, sigma**2)``; step ``t``
    routes every rank's tokens by ``softmax(x_t)`` (fresh sampling noise each
    step). ``rho`` near 1 drifts slowly; ``rho = 0`` draws independent steps.

    Iterating yields ``counts_RE`` (int64 ``[R, E]``) forever; :meth:`steps`
    returns ``[T, R, E]``. Deterministic given ``seed``.
    """

    _: KW_ONLY
    sigma: float = 1.0
    rho: float = 0.99

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sigma = check_range("sigma", self.sigma, 0.0, math.inf)
        self.rho = check_range("rho", self.rho, -1.0, 1.0)
        self.log_pop_E = start_log_popularity(self.num_experts, self.sigma, self._gen)

    @property
    def popularity(self) -> torch.Tensor:
        """pop_E: float64 ``[E]`` of the next step."""
        return torch.softmax(self.log_pop_E, dim=0)

    def step(self) -> torch.Tensor:
        """Counts of the current step (int64 ``[R, E]``), then advance the drift."""
        counts_RE = counts_for_ranks(self.popularity, self.tokens_R, self.topk, self._gen)
        self.log_pop_E = drift_log_popularity(self.log_pop_E, self.sigma, self.rho, self._gen)
        return counts_RE


@dataclass(eq=False, repr=False)
class RotatingHotspot(StepTrace):
    """Counts per step with one hot expert that moves to the next expert every ``period`` steps.

    Step ``t`` routes by :func:`popularity` ``"hot"`` with hot expert
    ``(start + t // period) % E`` (fresh sampling noise each step). Iterating
    yields int64 ``[R, E]`` forever; :meth:`steps` returns ``[T, R, E]``.
    Deterministic given ``seed``.
    """

    _: KW_ONLY
    period: int = 10
    hot_share: float = 0.5
    start: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.period = check_int("period", self.period, 1)
        self.hot_share = check_range("hot_share", self.hot_share, 0.0, 1.0)
        if self.hot_share == 1.0 and self.topk > 1:
            raise ValueError("hot_share = 1 leaves no other expert to pick when topk > 1")
        self.start = check_int("start", self.start, 0)
        self.t = 0

    @property
    def hot_expert(self) -> int:
        """Hot expert of the next step."""
        return (self.start + self.t // self.period) % self.num_experts

    def step(self) -> torch.Tensor:
        """Counts of the current step (int64 ``[R, E]``), then advance one step."""
        pop_E = hot_popularity(self.num_experts, self.hot_share, self.hot_expert, self._gen)
        self.t += 1
        return counts_for_ranks(pop_E, self.tokens_R, self.topk, self._gen)
