"""``ProfileReport`` (``profiling/report.py``): its figures add up, on spans built by hand
(where every figure is known) and on a real profile of two gloo ranks.

Legend: R ranks, T steps, P phases; spans are (rank, layer, step, phase, start s, end s).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

from moonplan import MoonMoE
from moonplan.profiling.report import ProfileReport, Span
from moonplan.profiling.session import profiling
from moonplan.testing.dist import run_ranks


def _waiting() -> ProfileReport:
    """2 ranks, 1 step, common clock: rank 0 is slow in ``counts`` (3 s), rank 1 in
    ``experts`` (2 s) after waiting for rank 0; rank 0's prefetch job (0.5 s) ran beside
    its ``experts`` and was exposed for 0.25 s; rank 1's job (1 s) was exposed for 2 s
    (submitting it cost more than the job)."""
    names = ("counts", "prefetch_exposed", "experts", "prefetch")
    spans = (
        Span(0, 0, 0, 0, 0.0, 3.0),
        Span(0, 0, 0, 1, 3.0, 3.25),
        Span(0, 0, 0, 2, 3.25, 4.25),
        Span(0, 0, 0, 3, 3.25, 3.75),
        Span(1, 0, 0, 0, 0.0, 1.0),
        Span(1, 0, 0, 1, 1.0, 3.0),
        Span(1, 0, 0, 2, 3.0, 4.5),
        Span(1, 0, 0, 3, 1.0, 2.0),
    )
    return ProfileReport(2, names, spans, "cpu perf_counter")


def test_phases_of_the_slowest_rank_add_up_to_its_step() -> None:
    report = _waiting()
    assert report.rank_step_s().tolist() == [[4.25], [4.5]]
    assert report.slowest_rank().tolist() == [1]
    assert report.critical_phase_s().tolist() == [[1.0, 2.0, 1.5, 1.0]]
    summ = report.summary()
    fg = ("counts", "prefetch_exposed", "experts")
    assert sum(summ[n]["mean_ms"] for n in fg) == pytest.approx(summ["step"]["mean_ms"])
    assert sum(summ[n]["share"] for n in fg) == pytest.approx(1.0)
    assert summ["wall"]["mean_ms"] == pytest.approx(4500.0)


def test_per_phase_maxima_are_not_additive_and_stay_out_of_the_table() -> None:
    """The old figure: the slowest rank of each phase, summed, exceeds the wall step
    (3 + 2 + 1.5 = 6.5 s against 4.5 s); it is only in the JSON, labelled as such."""
    report = _waiting()
    max_P = report.phase_max_s()[0]
    assert max_P[:3].sum() == pytest.approx(6.5)
    assert max_P[:3].sum() > report.wall_step_s()[0] == pytest.approx(4.5)
    data = report.to_json()
    assert data["phase_max_ms"]["counts"] == [pytest.approx(3000.0)]
    assert data["critical_phase_ms"]["counts"] == [pytest.approx(1000.0)]
    assert data["slowest_rank"] == [1]


def test_exposure_is_a_fraction_of_its_whole() -> None:
    """Rank 1 (the critical one) spent 2 s exposed on a 1 s job: 2/4.5 of the step. Of
    the jobs only rank 0's 0.25 s of 0.5 s surely ran beside other work: 1/6 of the
    1.5 s of jobs (not a 200% exposure)."""
    x = _waiting().exposure("prefetch")
    assert x is not None
    assert x["exposed_ms"] == pytest.approx(2000.0) and x["job_ms"] == pytest.approx(750.0)
    assert x["exposed_share"] == pytest.approx(2 / 4.5)
    assert x["hidden_at_least"] == pytest.approx(1 / 6)
    line = next(ln for ln in _waiting().table().splitlines() if ln.startswith("prefetch:"))
    assert "44.4% of the step" in line and "at least 17% of them hidden" in line


def test_a_mostly_hidden_job_reports_its_lower_bound() -> None:
    names = ("experts", "prefetch_exposed", "prefetch")
    spans = (
        Span(0, 0, 0, 0, 0.0, 1.0),
        Span(0, 0, 0, 1, 1.0, 1.1),
        Span(0, 0, 0, 2, 0.0, 1.1),
    )
    x = ProfileReport(1, names, spans, "cpu perf_counter").exposure("prefetch")
    assert x is not None and x["hidden_at_least"] == pytest.approx(1.0 / 1.1)
    assert ProfileReport(1, names[:2], spans[:2], "cpu perf_counter").exposure("prefetch") is None


def test_an_empty_report_has_zero_figures() -> None:
    report = ProfileReport(2, ("counts",), (), "cpu perf_counter")
    assert report.steps == 0 and report.critical_phase_s().shape == (0, 1)
    assert report.summary()["step"]["mean_ms"] == 0.0
    assert "2 ranks" in report.table()


def _profiled_rank(rank: int, world: int) -> Any:
    torch.manual_seed(0)
    layer = MoonMoE(64, 128, 8, 2, slots=1)
    x = torch.randn(96 + 64 * rank, 64, generator=torch.Generator().manual_seed(rank))
    layer(x).square().mean().backward()
    with profiling(layer) as prof:
        for _ in range(3):
            layer.zero_grad(set_to_none=True)
            layer(x.requires_grad_()).square().mean().backward()
    return prof.report


@pytest.mark.distributed
def test_a_real_profile_adds_up() -> None:
    """Per step: the slowest rank's foreground phases add up to its step, which is at
    most the wall step; no percentage in the table exceeds 100."""
    report: ProfileReport = run_ranks(_profiled_rank, 2, timeout=120)[0]
    crit_TP, fg = report.critical_phase_s(), report.foreground()
    step_T = report.rank_step_s().max(0)
    assert np.allclose(crit_TP[:, fg].sum(1), step_T)
    assert (step_T <= report.wall_step_s() + 1e-9).all()
    text = report.table()
    assert all(float(p) <= 100.0 for p in re.findall(r"([\d.]+)%", text)), text
