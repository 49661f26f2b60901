"""``moonplan.traces.persistence``: the variance split is recovered from generated traces.

Legend: T steps, R ranks, E experts; ``counts_TRE`` int64 ``[T, R, E]``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moonplan.simulate.workload import drifting_counts
from moonplan.traces.persistence import (
    Split,
    lag_covariance,
    persistence_split,
    popularity_correlation,
    trace_stats,
)


def _trace(persistent: float, rho: float, seed: int, steps: int = 300) -> torch.Tensor:
    return drifting_counts(4, 128, 2048, 4, sigma=1.0, steps=steps, rho=rho, seed=seed,
                           persistent=persistent)  # fmt: skip


@pytest.mark.parametrize(("persistent", "rho"), [(0.0, 0.9), (0.5, 0.95), (0.8, 0.9)])
def test_the_split_of_generated_traces_is_recovered(persistent: float, rho: float) -> None:
    """The generator's persistent share and drift correlation come back within sampling
    error (3 seeds: 128 experts, 300 steps, the drift decorrelating within 10-20 steps; the
    128 draws of ``mu`` alone make a seed's share wander by about 0.05)."""
    splits = [persistence_split(_trace(persistent, rho, seed)) for seed in range(3)]
    share = sum(s.share for s in splits) / len(splits)
    assert abs(share - persistent) < 0.06, [s.share for s in splits]
    assert all(abs(s.share - persistent) < 0.1 for s in splits), [s.share for s in splits]
    assert all(abs(s.rho - rho) < 0.02 for s in splits), [s.rho for s in splits]
    # the fitted variances add up to about the generator's sigma**2 = 1
    assert all(0.75 < s.persistent + s.fluctuating < 1.25 for s in splits)


def test_correlation_over_lags_follows_the_law() -> None:
    frozen = _trace(1.0, 0.9, 0, steps=120)  # nothing drifts: only sampling noise
    drift = _trace(0.0, 0.9, 0, steps=120)  # corr of log-shares 0.9**L
    assert popularity_correlation(frozen, 100) > 0.95
    assert popularity_correlation(drift, 1) > popularity_correlation(drift, 10)
    assert popularity_correlation(drift, 100) < 0.2
    assert popularity_correlation(frozen, 0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="lag"):
        popularity_correlation(frozen, 120)


def test_fit_by_hand() -> None:
    """A log-share process written out: mu fixed, x AR(1), exactly known covariances."""
    lags = np.arange(1, 40)
    y = 0.3 + 0.7 * 0.8**lags
    from moonplan.traces.persistence import _fit

    a, b, rho = _fit(lags, y)
    assert a == pytest.approx(0.3, abs=0.01) and b == pytest.approx(0.7, abs=0.02)
    assert rho == pytest.approx(0.8, abs=0.005)
    assert Split(0.3, 0.7, 0.0, 0.8).share == pytest.approx(0.3)
    assert Split(0.0, 0.0, 1.0, 0.5).share == 0.0
    y_TE = np.ones((5, 3))
    assert lag_covariance(y_TE, 2).tolist() == [1.0, 1.0, 1.0]


def test_trace_stats_reports_skew_correlation_and_split() -> None:
    stats = trace_stats(_trace(0.5, 0.95, 1, steps=150))
    assert stats["steps"] == 150 and stats["ranks"] == 4 and stats["experts"] == 128
    assert stats["records_per_rank"] == 2048 * 4
    assert set(stats["correlation"]) == {"1", "10", "100"}
    assert stats["static_max_over_mean"] > 1.0 and stats["expert_maxvio"] > 0.5
    assert 0.0 <= stats["split"]["share"] <= 1.0 and 0.0 < stats["mean_share"] <= 1.0
    frozen = torch.ones(5, 2, 4, dtype=torch.int64) * torch.tensor([1, 2, 3, 4])
    assert trace_stats(frozen)["mean_share"] == pytest.approx(1.0)
    assert all(math.isfinite(v) for v in stats["correlation"].values())
    with pytest.raises(ValueError, match="3 steps"):
        persistence_split(torch.ones(2, 1, 4, dtype=torch.int64))
