"""How persistent routing is: skew, popularity correlation over lags, and the variance split.

Legend:
    T steps    R ranks    E experts    L lag (steps)
    counts_TRE  int64 records rank ``r`` routes to expert ``e`` in step ``t``
    total_TE    float64 records of expert ``e`` in step ``t`` (summed over ranks)
    y_TE        float64 log-share of each expert, centred over the experts of each step
    cov_L       float64 mean over steps and experts of ``y_t * y_{t+L}``

The model the generator draws (``moonplan.traces.drift``): the log-popularity of expert
``e`` at step ``t`` is ``mu_e + x_t[e]`` with ``mu_e`` fixed (variance ``a``), ``x_t`` an AR(1)
process (stationary variance ``b``, correlation ``rho`` per step), and the router's sampling
noise on top (variance ``n``, independent from step to step). The log-shares then have

    cov(L) = a + b * rho**L    (L >= 1),    cov(0) = a + b + n

so :func:`persistence_split` fits ``a, b, rho`` to the measured ``cov(L)`` at lags 1 to
``T / 2`` (least squares: ``rho`` on a grid, ``a, b >= 0`` in closed form for each). The
*persistent share* is ``a / (a + b)``: the share of the log-popularity's variance (sampling
noise excluded) that stays with the expert. Sampling noise needs no model: it only enters
lag 0, which the fit leaves out. A trace shorter than a few times ``1 / (1 - rho)`` cannot
tell a slow drift from a persistent part; the fit then reports the drift it can see.
:func:`mean_share` is the plain load-space figure (the share of the per-expert load's
variance that is each expert's mean over the trace), sampling noise included.

:data:`PERSISTENT_SHARE` is the simulator's default split, measured on the shipped traces
of a trained model (``bench/make_real_traces.py``, ``moonplan/traces/data/index.json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from moonplan.plan.placement import static_alloc

PERSISTENT_SHARE = 0.996
"""Share of the log-popularity's variance that is persistent, the simulator's default
(``moonplan.simulate.workload``): the median of :func:`persistence_split`'s share over the
12 shipped traces (training, prefill and decode steps, 4 layers each; 0.62-0.76 while the
router trains, 0.95-1.00 at inference; ``docs/simulator.md``, "Real routing traces")."""

LAGS = (1, 10, 100)
"""Lags of the popularity correlation :func:`trace_stats` reports."""


def expert_totals(counts_TRE: Any) -> np.ndarray:
    """float64 ``[T, E]``: each step's records per expert (``[T, E]`` input is taken as is)."""
    c = torch.as_tensor(counts_TRE)
    if c.dim() == 3:
        c = c.sum(1)
    if c.dim() != 2 or c.shape[0] < 1:
        raise ValueError(f"counts must be [T, R, E] or [T, E], got {tuple(c.shape)}")
    return c.to(torch.float64).numpy()


def popularity_correlation(counts_TRE: Any, lag: int) -> float:
    """Mean over steps ``t`` of the Pearson correlation, across experts, of the records per
    expert at ``t`` and at ``t + lag`` (steps with constant loads are left out; ``nan`` when
    none is left)."""
    total_TE = expert_totals(counts_TRE)
    T = total_TE.shape[0]
    if not 0 <= lag < T:
        raise ValueError(f"lag {lag} needs a trace of more than {lag} steps, got {T}")
    a, b = total_TE[: T - lag], total_TE[lag:]
    a = a - a.mean(1, keepdims=True)
    b = b - b.mean(1, keepdims=True)
    den = np.sqrt((a * a).sum(1) * (b * b).sum(1))
    ok = den > 0
    return float(((a * b).sum(1)[ok] / den[ok]).mean()) if ok.any() else float("nan")


def log_shares(counts_TRE: Any) -> np.ndarray:
    """``y_TE``: ``log((total + 1/2) / step total)`` of each expert, minus its mean over the
    experts of the step (softmax is blind to a common shift)."""
    total_TE = expert_totals(counts_TRE)
    y = np.log(total_TE + 0.5) - np.log(total_TE.sum(1, keepdims=True) + 0.5)
    return y - y.mean(1, keepdims=True)


def lag_covariance(y_TE: np.ndarray, max_lag: int) -> np.ndarray:
    """``cov_L`` for ``L = 0 .. max_lag``: the mean of ``y[t] * y[t + L]`` over steps and
    experts (no mean subtracted over time: the model's processes have mean 0)."""
    T = y_TE.shape[0]
    return np.array([float((y_TE[: T - L] * y_TE[L:]).mean()) for L in range(max_lag + 1)])


@dataclass(frozen=True)
class Split:
    """The variance of the log-shares by part (:func:`persistence_split`).

    Attributes:
        persistent: ``a``, the variance of ``mu`` (fixed per expert).
        fluctuating: ``b``, the stationary variance of the drift ``x``.
        noise: ``cov(0) - a - b``, the step-to-step sampling noise (clipped at 0).
        rho: the drift's fitted correlation per step.
    """

    persistent: float
    fluctuating: float
    noise: float
    rho: float

    @property
    def share(self) -> float:
        """``a / (a + b)``: the persistent share of the popularity's variance (0 if none)."""
        total = self.persistent + self.fluctuating
        return self.persistent / total if total > 0 else 0.0


RHO_GRID = 1.0 - np.geomspace(1e-4, 0.9, 400)
"""Candidate ``rho`` of the fit: 0.1 to 0.9999, denser near 1."""


def persistence_split(counts_TRE: Any, max_lag: int | None = None) -> Split:
    """Fit ``cov(L) = a + b * rho**L`` at lags ``1 .. max_lag`` (default ``T // 2``, at least
    1; module docstring). Needs at least 3 steps."""
    y_TE = log_shares(counts_TRE)
    T = y_TE.shape[0]
    if T < 3:
        raise ValueError(f"a persistence split needs at least 3 steps, got {T}")
    L = max(2, T // 2) if max_lag is None else int(max_lag)
    if not 2 <= L < T:
        raise ValueError(f"max_lag must be in [2, {T - 1}], got {L}")
    cov = lag_covariance(y_TE, L)
    a, b, rho = _fit(np.arange(1, L + 1), cov[1:])
    return Split(a, b, max(0.0, float(cov[0]) - a - b), rho)


def _fit(lags: np.ndarray, cov: np.ndarray) -> tuple[float, float, float]:
    """``(a, b, rho) >= 0`` minimising ``sum (a + b rho**L - cov_L)**2`` over :data:`RHO_GRID`."""
    best = (np.inf, 0.0, 0.0, 0.0)
    for rho in RHO_GRID:
        a, b = _nonneg_line(rho**lags, cov)
        err = float(((a + b * rho**lags - cov) ** 2).sum())
        if err < best[0]:
            best = (err, a, b, float(rho))
    return best[1], best[2], best[3]


def _nonneg_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """``(a, b)``, both ``>= 0``, minimising ``sum (a + b x - y)**2``."""
    var = float(((x - x.mean()) ** 2).sum())
    b = float(((x - x.mean()) * (y - y.mean())).sum()) / var if var > 0 else 0.0
    a = float(y.mean()) - b * float(x.mean())
    if a >= 0 and b >= 0:
        return a, b
    # the best on each boundary, then the better of the two
    b0 = max(0.0, float((x * y).sum()) / float((x * x).sum()))
    a0 = max(0.0, float(y.mean()))
    e_b = float(((b0 * x - y) ** 2).sum())
    e_a = float(((a0 - y) ** 2).sum())
    return (0.0, b0) if e_b < e_a else (a0, 0.0)


def mean_share(counts_TRE: Any) -> float:
    """The share of the variance of per-expert load (each step's records per expert over
    the step's mean) that is each expert's mean over the trace: ``var_e(mean_t) /
    var_{t,e}`` (sampling noise included in the rest; 1.0 for constant loads)."""
    total_TE = expert_totals(counts_TRE)
    load_TE = total_TE / np.maximum(total_TE.mean(1, keepdims=True), 1e-300)
    total = float(load_TE.var())
    return float(load_TE.mean(0).var()) / total if total > 0 else 1.0


def static_imbalance(counts_TRE: Any) -> float:
    """Mean over steps of static EP's max / mean records per rank (linear placement)."""
    c = torch.as_tensor(counts_TRE).to(torch.int64)
    out = []
    for c_RE in c:
        load_R = static_alloc(c_RE).sum(0).to(torch.float64)
        out.append(float(load_R.max() / load_R.mean()) if load_R.sum() > 0 else 1.0)
    return sum(out) / len(out)


def trace_stats(counts_TRE: Any, lags: Sequence[int] = LAGS) -> dict[str, Any]:
    """Skew, correlation at ``lags`` (those shorter than the trace) and the variance split of
    a ``[T, R, E]`` trace, as plain numbers (``index.json`` holds these)."""
    c = torch.as_tensor(counts_TRE)
    total_TE = expert_totals(c)
    mean_E = total_TE.mean(1)
    split = persistence_split(c)
    return {
        "steps": int(c.shape[0]),
        "ranks": int(c.shape[1]),
        "experts": int(c.shape[2]),
        "records_per_rank": float(c.sum() / (c.shape[0] * c.shape[1])),
        "expert_maxvio": float((total_TE.max(1) / np.maximum(mean_E, 1e-300) - 1).mean()),
        "static_max_over_mean": static_imbalance(c),
        "correlation": {str(L): popularity_correlation(c, L) for L in lags if L < c.shape[0]},
        "mean_share": mean_share(c),
        "split": {**asdict(split), "share": split.share},
    }
