"""Run a rank's experts over its receive rows: home rows, slot rows, direct rows.

Legend:
    M home rows, B slots, D direct rows, W = M + B + D rows, F ffn, H hidden,
    P rows of this rank's receive buffer (``plan.recv_size()[rank]``)

The receive rows are grouped by row (``plan.row_offset[rank]``); the three
sections are contiguous, so each runs as one grouped GEMM with its own weights:
home rows with the layer's parameters, slots with the store's slot rows,
direct replicas with weights read from their home ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moonplan.plan.plan_type import Plan
from moonplan.runtime.experts import grouped_swiglu


def run_sections(
    x_PH: torch.Tensor,
    plan: Plan,
    rank: int,
    bounds_W1: Sequence[int],
    sections: list[tuple[int, torch.Tensor, torch.Tensor]],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU of every receive row with its row's expert weights (no host read).

    Args:
        x_PH: this rank's received rows.
        plan: the step's plan.
        rank: this rank.
        bounds_W1: ``plan.row_offset[rank]`` as ``W + 1`` host integers (read with the
            plan's other rows, ``moonplan.runtime.fetch_list.row_offsets``): each
            section's rows, and its offsets checked on the host.
        sections: ``(first_row, gate_up [n_i, 2F, H], down [n_i, H, F])`` in row
            order: the home rows (first row 0, ``n`` = the rank's own experts;
            rows up to ``M`` are empty), the slots (first row ``M``) and the direct
            rows (first row ``M + B``). Any subset, in row order.
        out: ``[P, H]`` rows to write into (the result of an earlier call with the
            other sections: the overlapped schedule runs the home section before the
            prefetched weights have arrived); default a new zero tensor.

    Returns:
        y_PH: expert outputs, same dtype as ``x_PH`` (padding rows are zero in, zero out);
        ``out`` itself when given.
    """
    offsets_W1 = plan.row_offset[rank]
    y_PH = x_PH.new_zeros(x_PH.shape) if out is None else out
    for first, gate_up, down in sections:
        last = first + gate_up.shape[0]
        a, b = bounds_W1[first], bounds_W1[last]
        if b > a:
            offs = offsets_W1[first : last + 1] - a
            host = [v - a for v in bounds_W1[first : last + 1]]
            y_PH[a:b] = grouped_swiglu(x_PH[a:b], offs, gate_up, down, bounds=host)
    return y_PH
