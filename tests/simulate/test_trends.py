"""The trends' progress reports (``moonplan.simulate.trends``).

Legend: R ranks (GPUs), E experts.
"""

from __future__ import annotations

from moonplan.simulate.trends import deepspeed_trend, gshard_trend


def test_each_trend_reports_every_size_then_done() -> None:
    """``progress(i, total, label)`` before each size, then ``(total, total, "done")``
    once the last size is simulated (what the sweeps report, and a progress bar closes on)."""
    ds: list[tuple[int, int, str]] = []
    gs: list[tuple[int, int, str]] = []
    assert len(deepspeed_trend(gpus=(8, 16), tokens=16, progress=lambda *a: ds.append(a))) == 2
    assert len(gshard_trend(experts=(128, 256), tokens=16, progress=lambda *a: gs.append(a))) == 2
    label = "deepspeed-moe GPUs"
    assert ds == [(0, 2, f"{label}=8"), (1, 2, f"{label}=16"), (2, 2, "done")]
    assert gs == [(0, 2, "gshard E=128"), (1, 2, "gshard E=256"), (2, 2, "done")]
