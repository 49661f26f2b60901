"""The shipped routing traces of a small trained MoE model (``moonplan/traces/data``).

Legend: T steps, R ranks (8), E experts (64); ``counts_TRE`` int64 ``[T, R, E]``.

``bench/make_real_traces.py`` trains a Qwen3-MoE-configured language model (4 layers, 64
experts, top-8, the router's auxiliary loss at 0.001) on the Python standard library's
sources and records every layer's routing, the batch split over 8 ranks:
``{kind}-l{layer}.npz`` with ``kind`` one of :data:`KINDS` (training steps, prefill-sized
batches of fresh text, decode steps of 128 running sequences) and ``layer`` 0 to 3.
``index.json`` holds the settings and each trace's statistics
(``moonplan.traces.persistence.trace_stats``). ``docs/simulator.md``, "Real routing
traces", reports them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from moonplan.traces.files import load_counts

DATA = Path(__file__).resolve().parent / "data"
"""The folder of the shipped traces."""
KINDS = ("train", "prefill", "decode")
"""The kinds of step recorded."""


def trace_names(kinds: tuple[str, ...] = KINDS) -> list[str]:
    """Names (``decode-l1``, ...) of the shipped traces of ``kinds``, sorted."""
    bad = set(kinds) - set(KINDS)
    if bad:
        raise ValueError(f"unknown trace kinds {sorted(bad)}; choose from {KINDS}")
    return sorted(p.stem for p in DATA.glob("*.npz") if p.stem.split("-l")[0] in kinds)


def real_trace(name: str) -> torch.Tensor:
    """``counts_TRE`` of the shipped trace ``name`` (e.g. ``"decode-l1"``)."""
    path = DATA / f"{name}.npz"
    if not path.exists():
        raise ValueError(f"no shipped trace {name!r}; choose from {', '.join(trace_names())}")
    return load_counts(path)


def real_traces(kinds: tuple[str, ...] = KINDS) -> dict[str, torch.Tensor]:
    """``{name: counts_TRE}`` of every shipped trace of ``kinds``."""
    return {name: real_trace(name) for name in trace_names(kinds)}


def index() -> dict[str, Any]:
    """``index.json``: the model's settings, the training log and every trace's statistics."""
    return json.loads((DATA / "index.json").read_text())
