"""``moonplan.traces.drift``: the one AR(1) drift law and its three users agree.

Legend: R ranks, E experts, S tokens per rank, K top-k, T steps; ``x_E`` log-popularity.
"""

from __future__ import annotations

import math

import pytest
import torch

from moonplan.cli.demo_ranks import DEMO_RHO, popularity_bias
from moonplan.simulate.workload import drifting_counts, popularity_maxvio
from moonplan.traces import (
    DriftingTrace,
    DriftLaw,
    RotatingHotspot,
    drift_log_popularity,
    start_log_popularity,
)


def _written_out(E: int, sigma: float, rho: float, seed: int, T: int, dtype: torch.dtype):
    """The law spelled out by hand: ``x0 = sigma z``, ``x <- rho x + sqrt(1-rho^2) sigma eps``."""
    g = torch.Generator().manual_seed(seed)
    x_E = sigma * torch.randn(E, generator=g, dtype=dtype)
    out = [x_E]
    for _ in range(T):
        eps_E = torch.randn(E, generator=g, dtype=dtype)
        x_E = rho * x_E + math.sqrt(1 - rho**2) * sigma * eps_E
        out.append(x_E)
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("sigma", "rho"), [(1.0, 0.99), (0.4, 0.0), (2.5, -0.5), (0.0, 0.9)])
def test_law_matches_the_formula_bit_for_bit(dtype: torch.dtype, sigma: float, rho: float) -> None:
    g = torch.Generator().manual_seed(3)
    x_E = start_log_popularity(11, sigma, g, dtype)
    got = [x_E]
    for _ in range(5):
        x_E = drift_log_popularity(x_E, sigma, rho, g)
        got.append(x_E)
    want = _written_out(11, sigma, rho, 3, 5, dtype)
    assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_rho_one_freezes_and_rho_zero_forgets() -> None:
    g = torch.Generator().manual_seed(0)
    x_E = start_log_popularity(7, 1.3, g)
    assert torch.equal(drift_log_popularity(x_E, 1.3, 1.0, g), x_E)
    fresh = drift_log_popularity(x_E, 1.3, 0.0, g)
    g2 = torch.Generator().manual_seed(0)
    start_log_popularity(7, 1.3, g2)
    torch.randn(7, generator=g2, dtype=torch.float64)  # the eps drawn by the rho = 1 step
    assert torch.equal(fresh, 1.3 * torch.randn(7, generator=g2, dtype=torch.float64))


@pytest.mark.parametrize(("sigma", "rho", "seed"), [(1.0, 0.99, 0), (0.7, 0.5, 4)])
def test_drifting_trace_equals_the_simulators_exact_counts(sigma: float, rho: float, seed: int):
    """Same seed, same law, same sampler: DriftingTrace and drifting_counts(exact=True)."""
    trace = DriftingTrace(3, 10, 40, 2, sigma=sigma, rho=rho, seed=seed).steps(6)
    sim = drifting_counts(3, 10, 40, 2, sigma=sigma, rho=rho, seed=seed, steps=6, exact=True,
                          persistent=0.0)  # fmt: skip
    assert torch.equal(trace, sim)
    # and with a persistent part: the same mu, the same walk
    trace = DriftingTrace(3, 10, 40, 2, sigma=sigma, rho=rho, seed=seed, persistent=0.6)
    sim = drifting_counts(3, 10, 40, 2, sigma=sigma, rho=rho, seed=seed, steps=6, exact=True,
                          persistent=0.6)  # fmt: skip
    assert torch.equal(trace.steps(6), sim)


def test_drifting_trace_follows_the_law() -> None:
    trace = DriftingTrace(2, 9, 5, 1, sigma=0.8, rho=0.9, seed=1)
    want = _written_out(9, 0.8, 0.9, 1, 0, torch.float64)[0]
    assert torch.equal(trace.log_pop_E, want)
    assert torch.equal(trace.popularity, torch.softmax(want, 0))


def test_demo_bias_is_the_law_in_float32() -> None:
    cfg = {"seed": 5, "experts": 12, "sigma": 1.1}
    want = _written_out(12, 1.1, DEMO_RHO, 5, 4, torch.float32)
    for step in range(5):
        assert torch.equal(popularity_bias(cfg, step), want[step])


def test_maxvio_reads_the_first_popularity() -> None:
    x_E = _written_out(16, 1.5, 0.99, 2, 0, torch.float64)[0]
    got = popularity_maxvio(1.5, 16, seed=2, persistent=0.0)
    assert got == float(torch.softmax(x_E, 0).max()) * 16 - 1.0


# ---- traces over steps --------------------------------------------------------------------------


def step_correlation(steps_TRE: torch.Tensor) -> float:
    """Mean correlation of expert loads between consecutive steps."""
    load_TE = steps_TRE.sum(1).double()
    corr = [torch.corrcoef(load_TE[t : t + 2])[0, 1] for t in range(load_TE.shape[0] - 1)]
    return float(torch.stack(corr).mean())


def test_drifting_trace_shapes_sums_and_determinism() -> None:
    trace = DriftingTrace(3, 10, [5, 0, 9], 2, seed=4)
    steps_TRE = trace.steps(6)
    assert steps_TRE.shape == (6, 3, 10) and steps_TRE.dtype == torch.int64
    assert steps_TRE.sum(2).tolist() == [[10, 0, 18]] * 6
    assert torch.equal(DriftingTrace(3, 10, [5, 0, 9], 2, seed=4).steps(6), steps_TRE)
    assert next(iter(trace)).shape == (3, 10)
    assert trace.steps(0).shape == (0, 3, 10)


def test_drift_correlates_for_rho_near_one_and_not_for_rho_zero() -> None:
    slow = DriftingTrace(2, 256, 1024, 4, sigma=1.0, rho=0.99, seed=0).steps(5)
    fresh = DriftingTrace(2, 256, 1024, 4, sigma=1.0, rho=0.0, seed=0).steps(5)
    assert step_correlation(slow) > 0.8
    assert abs(step_correlation(fresh)) < 0.2


def test_drift_keeps_the_stationary_spread() -> None:
    trace = DriftingTrace(1, 2048, 1, 1, sigma=1.5, rho=0.9, seed=2)
    for _ in range(20):
        trace.step()
    assert 1.35 < float(trace.log_pop_E.std()) < 1.65


def test_rotating_hotspot_moves_every_period() -> None:
    trace = RotatingHotspot(2, 5, 40, 2, period=3, hot_share=0.8, start=3, seed=1)
    steps_TRE = trace.steps(12)
    hot_T = steps_TRE.sum(1).argmax(1).tolist()
    assert hot_T == [(3 + t // 3) % 5 for t in range(12)]
    assert bool((steps_TRE.sum(2) == 80).all())
    assert trace.hot_expert == (3 + 12 // 3) % 5


def test_step_trace_errors() -> None:
    with pytest.raises(ValueError, match="rho"):
        DriftingTrace(2, 4, 8, 2, rho=1.5)
    with pytest.raises(ValueError, match="exceeds the number of experts"):
        DriftingTrace(2, 4, 8, 5)
    with pytest.raises(ValueError, match="period"):
        RotatingHotspot(2, 4, 8, 2, period=0)
    with pytest.raises(ValueError, match="hot_share = 1"):
        RotatingHotspot(2, 4, 8, 2, hot_share=1.0)


def test_drift_law_checks_its_fields_and_serves_the_trace() -> None:
    for bad in ({"sigma": -1.0}, {"sigma": math.nan}, {"rho": 1.5}, {"persistent": 1.5}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            DriftLaw(**{"sigma": 1.0, "persistent": 0.5, **bad})
    trace = DriftingTrace(2, 8, 16, 2, sigma=2, rho=0.5, seed=3, persistent=0.25)
    assert trace.law == DriftLaw(sigma=2.0, rho=0.5, seed=3, persistent=0.25)
    assert trace.law.sigma_f == pytest.approx(math.sqrt(3.0))
    assert torch.equal(trace.mu_E, trace.law.persistent_part(8))
    assert torch.equal(trace.log_pop_E, trace.law.start(8))  # the trace's first draw
