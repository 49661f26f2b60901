"""Chrome trace of a profile: the ``traceEvents`` JSON of chrome://tracing and Perfetto.

Legend: R ranks (``pid``), L layers (``tid``; user regions get ``tid = USER_TID``,
background phases of layer ``l`` get ``tid = BACKGROUND_TID + l``).

One complete event (``"ph": "X"``) per span, ``ts``/``dur`` in microseconds from
the profiler's common origin, ``args`` with the step; metadata events
(``"ph": "M"``) name the processes ``rank r`` and the threads ``layer l`` (and
``layer l background`` for the prefetch and reduce jobs, which overlap the layer's
other phases and so get a row of their own).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moonplan.profiling.phases import BACKGROUND_PHASES
from moonplan.profiling.report import USER_LAYER, ProfileReport

USER_TID = 1_000_000
"""Thread id of user regions (``Profiler.phase``), shown below the layers."""
BACKGROUND_TID = 500_000
"""Thread id offset of each layer's background phases."""


def _tid(layer: int, phase: str = "") -> int:
    if layer == USER_LAYER:
        return USER_TID
    return BACKGROUND_TID + layer if phase in BACKGROUND_PHASES else layer


def _metadata(report: ProfileReport) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for r in range(report.ranks):
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}}
        )
        for layer in report.layers:
            name = "user" if layer == USER_LAYER else f"layer {layer}"
            threads = [(_tid(layer), name)]
            if layer != USER_LAYER:
                threads.append((_tid(layer, BACKGROUND_PHASES[0]), f"{name} background"))
            for tid, label in threads:
                events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": r,
                        "tid": tid,
                        "args": {"name": label},
                    }
                )
    return events


def chrome_trace(report: ProfileReport) -> dict[str, Any]:
    """The trace as a dict: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData"}``."""
    events = _metadata(report)
    for s in report.spans:
        events.append(
            {
                "name": report.phases[s.phase],
                "cat": "moonplan",
                "ph": "X",
                "ts": 1e6 * s.start,
                "dur": max(0.0, 1e6 * (s.end - s.start)),
                "pid": s.rank,
                "tid": _tid(s.layer, report.phases[s.phase]),
                "args": {"step": s.step, "layer": s.layer},
            }
        )
    other = {"clock": report.clock, "aligned": report.aligned, "ranks": report.ranks}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(report: ProfileReport, path: str | Path) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path``; returns the path."""
    p = Path(path)
    p.write_text(json.dumps(chrome_trace(report)) + "\n")
    return p
