"""Gather every rank's profile spans over the EP group (two all-gathers of fixed-size data).

Legend:
    R ranks, N spans of this rank, Nmax the most spans on any rank
    row   ``(layer, step, phase id, start s, end s)``; phase ids index the rank's name list
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moonplan.comm.group import EPGroup
from moonplan.profiling.report import Span

NAMES_MAX_BYTES = 1 << 14  # the longest "\n"-joined list of phase names a rank may send


def merged_names(per_rank: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """Every rank's phase names, each once: rank 0's order, then later ranks' new names."""
    out: dict[str, None] = {}
    for names in per_rank:
        out.update(dict.fromkeys(names))
    return tuple(out)


def gather_spans(
    group: EPGroup, rows: Sequence[tuple[int, int, int, float, float]], names: Sequence[str]
) -> tuple[tuple[Span, ...], tuple[str, ...]]:
    """Collective: every rank's spans, with phase ids made global.

    Args:
        group: the EP group (every rank calls this once).
        rows: this rank's spans as ``(layer, step, phase id, start, end)`` (seconds).
        names: this rank's phase names (``names[id]``).

    Returns:
        ``(spans, names)``: the spans of all ranks, ordered by rank then recording
        order, with ``Span.phase`` an index into the merged ``names``.
    """
    raw = group.all_gather_bytes("\n".join(names).encode(), NAMES_MAX_BYTES)
    per_rank = [b.decode().split("\n") if b else [] for b in raw]
    merged = merged_names(per_rank)
    index = {n: i for i, n in enumerate(merged)}
    n_R = group.all_gather(torch.tensor([len(rows)], dtype=torch.int64)).view(-1).tolist()
    rows_N5 = torch.zeros(max(1, *n_R), 5, dtype=torch.float64)
    if rows:
        rows_N5[: len(rows)] = torch.tensor(rows, dtype=torch.float64)
    all_RN5 = group.all_gather(rows_N5).cpu()
    spans = []
    for r in range(group.size):
        for layer, step, pid, start, end in all_RN5[r, : n_R[r]].tolist():
            phase = index[per_rank[r][int(pid)]]
            spans.append(Span(r, int(layer), int(step), phase, start, end))
    return tuple(spans), merged
