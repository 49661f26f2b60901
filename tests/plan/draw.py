"""Hypothesis helpers shared by the planner tests.

Legend: R ranks, E experts; counts int64 ``[R, E]``.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from moonplan.testing import counts


def counts_like(data: st.DataObject, c: torch.Tensor) -> torch.Tensor:
    """Counts drawn with the shape ``[R, E]`` of ``c`` (a later step of the same layer)."""
    R, E = c.shape
    return data.draw(counts(min_ranks=R, max_ranks=R, min_experts=E, max_experts=E))
