"""Router counts over steps: the law of log-popularity over steps, and the step traces.

The law is written once, here. The log-popularity of expert ``e`` at step ``t`` is
``mu_e + x_t[e]``:

* ``mu_E`` (:func:`persistent_log_popularity`) is fixed for a trace: the persistent part,
  the experts that stay popular (a share ``persistent`` of the variance, ``sigma_p**2``);
* ``x_E`` drifts as an AR(1) process of stationary std ``sigma_f``:
  :func:`start_log_popularity` draws the stationary start, :func:`drift_log_popularity`
  takes one step and :func:`jump_log_popularity` takes ``n`` at once (the same law);
* the router's sampling noise comes on top (the samplers of ``generators``).

``sigma_p**2 + sigma_f**2 = sigma**2`` (:func:`split_sigma`), so ``sigma`` keeps its meaning,
the total spread; :class:`DriftLaw` holds one trace's ``sigma``, ``rho``, ``seed`` and
``persistent`` share, checked once. ``persistent=0`` is the earlier model (no persistent
part): the walk then draws exactly the numbers it drew before, since ``mu_E`` comes from a
generator of its own.
:class:`DriftingTrace`, the simulator's ``simulate.workload`` and the CLI demo's router
bias all call these functions, so the same seed gives the same popularities everywhere.
How much of the variance is persistent in real routing is measured by
``moonplan.traces.persistence`` (its ``PERSISTENT_SHARE``).

Legend:
    R ranks    E experts    K top-k    T steps of a trace
    mu_E      float persistent log-popularity of each expert (fixed per trace)
    x_E       float fluctuating log-popularity (``softmax(mu_E + x_E)`` is ``pop_E``)
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


def split_sigma(sigma: float, persistent: float) -> tuple[float, float]:
    """``(sigma_p, sigma_f)``: the stds of the persistent and the fluctuating part of a
    log-popularity of total std ``sigma`` whose variance is a share ``persistent`` in
    ``[0, 1]`` persistent (``sigma_p**2 + sigma_f**2 = sigma**2``)."""
    check_range("persistent", persistent, 0.0, 1.0)
    return sigma * math.sqrt(persistent), sigma * math.sqrt(1.0 - persistent)


MU_SEED_OFFSET = 1 << 62
"""``mu_E`` of seed ``s`` is drawn from a generator seeded ``s + MU_SEED_OFFSET`` (its own
stream: the walk's draws do not depend on the persistent share)."""


def persistent_log_popularity(
    experts: int, sigma: float, persistent: float, seed: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """mu_E: ``sigma_p * z`` with ``z ~ N(0, I)`` from a generator of its own, seeded
    ``seed + MU_SEED_OFFSET``; exact zeros when ``persistent == 0``.

    Returns:
        ``dtype`` ``[experts]``.
    """
    sigma_p, _ = split_sigma(sigma, persistent)
    if sigma_p == 0:
        return torch.zeros(experts, dtype=dtype)
    gen = make_generator(int(seed) + MU_SEED_OFFSET)
    return sigma_p * torch.randn(experts, generator=gen, dtype=dtype)


def jump_log_popularity(
    x_E: torch.Tensor, sigma: float, rho: float, steps: int, gen: torch.Generator
) -> torch.Tensor:
    """x_E ``steps`` steps later in one draw: ``rho**n * x + sqrt(1 - rho**(2n)) * sigma * eps``,
    the law of ``n`` :func:`drift_log_popularity` steps (not the same numbers). The AR(1)
    process is reversible, so the same call also draws ``x`` ``steps`` steps *earlier*."""
    n = check_int("steps", steps, 0)
    eps_E = torch.randn(x_E.shape[0], generator=gen, dtype=x_E.dtype)
    decay = rho**n
    return decay * x_E + math.sqrt(max(0.0, 1.0 - decay * decay)) * sigma * eps_E


@dataclass(frozen=True, kw_only=True)
class DriftLaw:
    """The law of one trace's log-popularity ``mu_E + x_E`` (module docstring), checked when
    made (``ValueError`` naming the field).

    Attributes:
        sigma: total std of the log-popularity, ``>= 0``.
        rho: correlation of ``x_E`` from one step to the next, in ``[-1, 1]``.
        seed: seeds ``x_E``'s generator (``mu_E``'s is ``seed + MU_SEED_OFFSET``).
        persistent: share of ``sigma**2`` in ``mu_E``, in ``[0, 1]`` (no default: a
            :class:`DriftingTrace` defaults to 0, the simulator to the measured share).
    """

    sigma: float
    persistent: float
    rho: float = 0.99
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sigma", check_range("sigma", self.sigma, 0.0, math.inf))
        object.__setattr__(self, "rho", check_range("rho", self.rho, -1.0, 1.0))
        check_range("persistent", self.persistent, 0.0, 1.0)

    @property
    def sigma_f(self) -> float:
        """Stationary std of the drifting part ``x_E`` (:func:`split_sigma`)."""
        return split_sigma(self.sigma, self.persistent)[1]

    def persistent_part(self, experts: int) -> torch.Tensor:
        """mu_E: float64 ``[experts]`` (:func:`persistent_log_popularity`)."""
        return persistent_log_popularity(experts, self.sigma, self.persistent, self.seed)

    def start(self, experts: int, gen: torch.Generator | None = None) -> torch.Tensor:
        """x_E of step 0: float64 ``[experts]`` drawn from ``gen`` (default: the first draw of
        a new generator seeded ``seed``, as a trace of this law starts)."""
        gen = make_generator(self.seed) if gen is None else gen
        return start_log_popularity(experts, self.sigma_f, gen)


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
    """Counts per step whose log-popularity is ``mu + x_t`` (module docstring).

    ``x_{t+1} = rho * x_t + sqrt(1 - rho**2) * sigma_f * eps_t`` with ``eps_t ~ N(0, I)``
    per expert, started from the stationary law ``N(0, sigma_f**2)``; ``mu`` is fixed
    (std ``sigma_p``; ``persistent`` is the share ``sigma_p**2 / sigma**2``, default 0:
    no persistent part); step ``t`` routes every rank's tokens by ``softmax(mu + x_t)``
    (fresh sampling noise each step). ``rho`` near 1 drifts slowly; ``rho = 0`` draws
    independent steps.

    Iterating yields ``counts_RE`` (int64 ``[R, E]``) forever; :meth:`steps`
    returns ``[T, R, E]``. Deterministic given ``seed``.
    """

    _: KW_ONLY
    sigma: float = 1.0
    rho: float = 0.99
    persistent: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        law = DriftLaw(sigma=self.sigma, rho=self.rho, seed=self.seed, persistent=self.persistent)
        self.law, self.sigma, self.rho, self.sigma_f = law, law.sigma, law.rho, law.sigma_f
        self.mu_E = law.persistent_part(self.num_experts)
        self.log_pop_E = law.start(self.num_experts, self._gen)

    @property
    def popularity(self) -> torch.Tensor:
        """pop_E: float64 ``[E]`` of the next step."""
        return torch.softmax(self.mu_E + self.log_pop_E, dim=0)

    def step(self) -> torch.Tensor:
        """Counts of the current step (int64 ``[R, E]``), then advance the drift."""
        counts_RE = counts_for_ranks(self.popularity, self.tokens_R, self.topk, self._gen)
        self.log_pop_E = drift_log_popularity(self.log_pop_E, self.sigma_f, self.rho, self._gen)
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
