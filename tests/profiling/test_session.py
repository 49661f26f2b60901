"""moonplan.profile (``profiling/session.py``): phase spans, their cost when off, the report,
Chrome trace, PNG and CLI.

Legend: R ranks, T profiled steps, H hidden, F ffn, E experts, K top-k, S tokens per rank.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from moonplan import MoonMoE
from moonplan.cli import profile as cli_profile
from moonplan.cli.profile_ranks import ids_from_counts
from moonplan.profiling.chrome import BACKGROUND_TID, write_chrome_trace
from moonplan.profiling.gather import merged_names
from moonplan.profiling.report import ProfileReport, Span
from moonplan.profiling.session import (
    BACKGROUND_PHASES,
    BACKWARD_PHASES,
    NULL_PROFILER,
    PHASES,
    USER_LAYER,
    NullProfiler,
    Profiler,
    profiling,
)
from moonplan.testing.dist import run_ranks

R, T = 2, 4
# Sizes where the experts' matmuls, not Python, make up the step (about 50 ms per rank).
H, F, E, K, S = 256, 512, 8, 2, 384


def _layer(seed: int = 0, **kw: Any) -> MoonMoE:
    torch.manual_seed(seed)
    return MoonMoE(kw.pop("H", H), kw.pop("F", F), E, K, **kw)


def _step(layer: MoonMoE, x: torch.Tensor, backward: bool = True) -> None:
    y = layer(x)
    if backward:
        y.square().mean().backward()


def _profiled_rank(rank: int, world: int) -> dict[str, Any]:
    """Warm up, then T profiled forward+backward steps, each timed around the whole call."""
    layer = _layer()
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    _step(layer, x)
    walls = []
    with profiling(layer) as prof:
        for _ in range(T):
            layer.zero_grad(set_to_none=True)  # as optimizers do: no gradient accumulation
            x.grad = None
            t0 = time.perf_counter()
            _step(layer, x)
            walls.append(time.perf_counter() - t0)
    return {"report": prof.report, "walls": walls}


@pytest.fixture(scope="module")
def profiled() -> list[dict[str, Any]]:
    return run_ranks(_profiled_rank, R, timeout=120)


@pytest.mark.distributed
def test_phases_sum_to_the_measured_step_time(profiled: list[dict[str, Any]]) -> None:
    """On every rank the recorded phases add up to the wall time of forward+backward
    (measured around the call) within 10%; the rest is routing and autograd glue."""
    report: ProfileReport = profiled[0]["report"]
    per_rank_T = report.rank_phase_s()[:, :, report.foreground()].sum(2)  # background overlaps
    for r in range(R):
        wall, phases = sum(profiled[r]["walls"]), float(per_rank_T[r].sum())
        assert phases <= wall
        assert abs(wall - phases) <= 0.10 * wall, (r, wall, phases)
    assert report.present == PHASES


def test_off_costs_under_two_percent() -> None:
    """Method: instead of comparing two noisy wall-clock runs, count the hook calls one
    forward+backward makes (with a counting hook installed), time 10^5 calls of the no-op
    hooks through the same attribute path the runtime uses, and compare that cost per step
    with the median step time of the demo's (small) layer size on one rank. The no-op hooks
    are the only code that profiling-off adds to a step, so this bounds their overhead."""
    layer = _layer(H=64, F=128)
    rt = layer.runtime
    x = torch.randn(256, 64).requires_grad_()
    counter = _CountingHook()
    rt.profiler = counter  # type: ignore[assignment]
    _step(layer, x)
    calls = counter.calls
    rt.profiler = NULL_PROFILER
    steps = []
    for _ in range(7):
        t0 = time.perf_counter()
        _step(layer, x)
        steps.append(time.perf_counter() - t0)
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        rec = rt.profiler.begin_step()
        rec.span("dispatch", 0.0, 0.0)
    per_pair = (time.perf_counter() - t0) / n
    cost = calls / 2 * per_pair
    assert 10 <= calls <= 20, calls
    assert cost < 0.02 * statistics.median(steps), (cost, statistics.median(steps))


class _CountingHook:
    """Counts every hook call (begin_step, begin, span, background, traffic) of one step."""

    def __init__(self) -> None:
        self.calls = 0

    def begin_step(self) -> _CountingHook:
        self.calls += 1
        return self

    def begin(self) -> None:
        self.calls += 1

    def span(self, name: str, t0: float, t1: float) -> None:
        self.calls += 1

    def background(self, name: str, t0: float, t1: float, events: object = None) -> None:
        self.calls += 1

    def traffic(self, records: int, rows_sent: int) -> None:
        self.calls += 1


def test_null_profiler_is_immutable_and_the_default() -> None:
    with pytest.raises(AttributeError):
        NULL_PROFILER.x = 1  # type: ignore[attr-defined]
    assert isinstance(_layer(H=8, F=8).runtime.profiler, NullProfiler)


def test_spans_are_the_step_stats_and_hooks_are_removed() -> None:
    """On CPU a span is the runtime's own perf_counter readings: they equal StepStats."""
    layer = _layer(H=16, F=16)
    x = torch.randn(32, 16).requires_grad_()
    with profiling(torch.nn.Sequential(layer)) as prof:
        assert not isinstance(layer.runtime.profiler, NullProfiler)
        _step(layer, x)
        with prof.phase("loss"):
            pass
    assert layer.runtime.profiler is NULL_PROFILER
    stats = layer.last_stats
    assert stats is not None
    report = prof.report
    d = report.rank_phase_s()[0, 0]
    for name, seconds in stats.phases.items():
        assert d[report.phases.index(name)] == pytest.approx(seconds, rel=1e-9, abs=1e-12)
    assert report.present == (*PHASES, "loss")
    assert USER_LAYER in report.layers


def test_errors_detach_without_gathering() -> None:
    layer = _layer(H=8, F=8)
    with pytest.raises(ValueError, match="no MoonMoE"), profiling(torch.nn.Linear(2, 2)):
        pass
    with pytest.raises(KeyError), profiling([layer]) as prof:
        with pytest.raises(RuntimeError, match="already being profiled"):
            Profiler(layer.group).start([layer.runtime])
        raise KeyError("boom")
    assert layer.runtime.profiler is NULL_PROFILER
    with pytest.raises(RuntimeError, match="gathered when profiling ends"):
        _ = prof.report


@pytest.mark.distributed
def test_chrome_trace_has_one_event_per_phase_step_and_rank(
    profiled: list[dict[str, Any]], tmp_path: Path
) -> None:
    report: ProfileReport = profiled[0]["report"]
    path = write_chrome_trace(report, tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    keys = {(e["pid"], e["tid"], e["name"], e["args"]["step"]) for e in spans}
    assert len(keys) == R * T * len(PHASES)
    # experts and prefetch_exposed: two spans a step (home rows, wait, slot and direct rows)
    assert len(spans) == R * T * (len(PHASES) + 2)
    assert {k[0] for k in keys} == set(range(R)) and {k[1] for k in keys} == {0, BACKGROUND_TID}
    assert all(e["tid"] == BACKGROUND_TID for e in spans if e["name"] in BACKGROUND_PHASES)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert [e["args"]["name"] for e in names] == [f"rank {r}" for r in range(R)]


@pytest.mark.distributed
def test_table_has_p50_and_p90_per_phase(profiled: list[dict[str, Any]]) -> None:
    report: ProfileReport = profiled[0]["report"]
    lines = report.table().splitlines()
    assert "p50 ms" in lines[1] and "p90 ms" in lines[1]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    for name in PHASES:
        p50, p90 = float(rows[name][1]), float(rows[name][2])
        assert 0 <= p50 <= p90
    summ = report.summary()
    fg = [n for n in PHASES if n not in BACKGROUND_PHASES]
    assert sum(summ[n]["share"] for n in fg) == pytest.approx(1.0)
    text = report.table()
    assert "grad_reduce:" in text and "exposed" in text  # background total vs exposed part
    assert len(summ["step"]["rank_mean_ms"]) == R
    json.dumps(report.to_json())


def test_png_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from moonplan.profiling.plot import plot_phase_bars

    path = plot_phase_bars(_synthetic(), tmp_path / "profile_phases.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moonplan.profiling.plot import plot_phase_bars

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_phase_bars(_synthetic(), tmp_path / "x.png")


def _synthetic() -> ProfileReport:
    """2 ranks, 2 steps of one layer: rank 1 is slower in "experts" (seconds)."""
    names = ("counts", "experts")
    spans = []
    for r in range(2):
        for t in range(2):
            base = 10.0 * t
            spans.append(Span(r, 0, t, 0, base, base + 1.0))
            spans.append(Span(r, 0, t, 1, base + 1.0, base + 2.0 + r))
    return ProfileReport(2, names, tuple(spans), "cpu perf_counter")


def test_critical_path_is_the_slowest_rank_per_phase() -> None:
    report = _synthetic()
    crit = report.critical_phase_s()
    assert crit.tolist() == [[1.0, 2.0], [1.0, 2.0]]
    assert report.wall_step_s().tolist() == [3.0, 3.0]
    summ = report.summary()
    assert summ["experts"]["p50_ms"] == pytest.approx(2000.0)
    assert summ["experts"]["share"] == pytest.approx(2 / 3)
    assert summ["step"]["mean_ms"] == pytest.approx(3000.0)
    assert summ["experts"]["rank_max_over_mean"] == pytest.approx(2 / 1.5)


def test_merged_names_keep_rank_order() -> None:
    assert merged_names([["a", "b"], ["b", "c"], []]) == ("a", "b", "c")


def test_ids_from_counts_match_counts_with_distinct_picks() -> None:
    counts = torch.tensor([3, 0, 2, 1, 2])
    ids = ids_from_counts(counts, 2)
    assert ids.shape == (4, 2)
    assert torch.bincount(ids.view(-1), minlength=5).tolist() == counts.tolist()
    assert bool((ids[:, 0] != ids[:, 1]).all())


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli_profile.register(parser.add_subparsers())
    args = parser.parse_args(["profile", *argv])
    return int(args.func(args))


@pytest.mark.distributed
def test_cli_replays_a_trace_and_writes_outputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moonplan.traces import DriftingTrace, save_counts

    save_counts(tmp_path / "t.npy", DriftingTrace(2, 8, 64, 2, seed=1).steps(2))
    out = tmp_path / "out"
    argv = ["--trace", str(tmp_path / "t.npy"), "--steps", "3", "--warmup", "1"]
    assert _cli([*argv, "--backward", "--aligned", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "p50 ms" in text and "grad_reduce" in text and "profile_trace.json" in text
    data = json.loads((out / "profile.json").read_text())
    assert data["ranks"] == 2 and data["steps"] == 3 and data["config"]["experts"] == 8
    assert json.loads((out / "profile_trace.json").read_text())["traceEvents"]
    assert (out / "profile_phases.png").exists() or "skipped the PNG" in text
    assert _cli([*argv, "--ranks", "3"]) == 2


class _FakeEvent:
    """Stands in for ``torch.cuda.Event``: remembers perf_counter when recorded."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _FakeEvent) -> float:
        return 1e3 * (end.t - self.t)


class _EventProfiler(Profiler):
    """The CUDA-event code path on CPU: fake events, no device synchronisation."""

    def __init__(self, group: Any) -> None:
        super().__init__(group)
        self.cuda = True

    def mark(self) -> _FakeEvent:
        return _FakeEvent()

    def _synchronize(self) -> None:
        pass


def test_event_path_chains_boundaries_per_sequence() -> None:
    """With events, each phase runs from the previous boundary to its own end event:
    the forward's and the backward's phases tile their sequences without gaps."""
    layer = _layer(H=16, F=16)
    x = torch.randn(32, 16).requires_grad_()
    prof = _EventProfiler(layer.group).start([layer.runtime])
    _step(layer, x)
    report = prof.finish()
    # A CPU layer's background jobs have no events: left out on the event path.
    fg = tuple(n for n in PHASES if n not in BACKGROUND_PHASES)
    assert report.clock == "cuda events" and report.present == fg
    spans = sorted(report.spans, key=lambda s: s.start)
    for seq in (spans[:8], spans[8:]):
        assert all(a.end == b.start for a, b in itertools.pairwise(seq))
    forward = ["counts", "plan", "prefetch_exposed", "dispatch", "experts"]
    forward += ["prefetch_exposed", "experts", "combine"]  # home rows, wait, remote rows
    backward = [n for n in BACKWARD_PHASES if n not in BACKGROUND_PHASES]
    assert [report.phases[s.phase] for s in spans] == forward + backward
    assert spans[8].start > spans[7].end  # the backward opened its own sequence


@pytest.mark.distributed
def test_report_counts_records_and_rows_per_record(profiled: list[dict[str, Any]]) -> None:
    report: ProfileReport = profiled[0]["report"]
    assert report.traffic == (R * T * S * K, R * T * S * K)  # one row per record (heap)
    assert report.rows_per_record == 1.0 and "rows per record: 1.000" in report.table()


def _token_rows_rank(rank: int, world: int) -> dict[str, Any]:
    from moonplan.runtime.transports.registry import builtin_name

    layer = _layer(H=16, F=16, transport=builtin_name("heap", "tokens"))
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(rank))
    sent = []
    with profiling(layer) as prof:
        for _ in range(2):
            _step(layer, x)
            assert layer.last_stats is not None
            sent.append((layer.last_stats.records, layer.last_stats.rows_sent))
    return {"report": prof.report, "sent": sent}


@pytest.mark.distributed
def test_report_rows_per_record_of_token_rows() -> None:
    got = run_ranks(_token_rows_rank, R, timeout=120)
    records = sum(r for g in got for r, _ in g["sent"])
    rows = sum(n for g in got for _, n in g["sent"])
    report: ProfileReport = got[0]["report"]
    assert report.traffic == (records, rows) == got[1]["report"].traffic
    assert records == R * 2 * 24 * K and rows < records  # a token's 2 records share rows
    assert f"rows per record: {rows / records:.3f}" in report.table()
    assert report.to_json()["rows_per_record"] == rows / records
