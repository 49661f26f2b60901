"""Input validation for the planner: one canonical counts tensor, or a PlanError.

Legend: R ranks, E experts.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.errors import PlanError

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def as_counts(
    counts: Any, num_ranks: int | None = None, *, check_values: bool = True
) -> torch.Tensor:
    """Validate ``counts`` and return it as an int64 tensor ``[R, E]``.

    Accepts a torch tensor, a numpy array or nested lists of integers. Raises
    :class:`PlanError` for anything that is not a 2-D, non-empty, non-negative
    integer array, or whose first dimension differs from ``num_ranks``.
    ``check_values=False`` skips the value check (negative entries), which reads
    the data on the host: on CUDA that is a synchronisation, so graph capture
    turns it off and relies on the caller.
    Nothing is modified: the result is a fresh tensor when a conversion is needed.
    """
    if not isinstance(counts, torch.Tensor):
        try:
            counts = torch.as_tensor(counts)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise PlanError(
                f"counts must be an integer array [R, E]; could not read it: {exc}"
            ) from None
    if counts.dtype not in _INT_DTYPES:
        raise PlanError(f"counts must have an integer dtype, got {counts.dtype}")
    if counts.dim() != 2:
        raise PlanError(
            f"counts must be 2-D [R, E] (source rank x expert), got shape {tuple(counts.shape)}"
        )
    R, E = counts.shape
    if R < 1 or E < 1:
        raise PlanError(f"counts must have at least one rank and one expert, got shape {(R, E)}")
    if num_ranks is not None and R != num_ranks:
        raise PlanError(f"counts has {R} rows (source ranks) but the group has {num_ranks} ranks")
    counts_RE = counts.to(torch.int64)
    if check_values:
        _check_nonnegative(counts_RE)
    return counts_RE


def _check_nonnegative(counts_RE: torch.Tensor) -> None:
    bad = counts_RE < 0
    if bool(bad.any()):
        s, e = (int(v) for v in bad.nonzero()[0])
        raise PlanError(
            f"counts must be non-negative: counts[{s}, {e}] = {int(counts_RE[s, e])} "
            f"(source rank {s}, expert {e})"
        )


def check_options(slots: int | None, align: int, max_local: int) -> int:
    """Validate ``slots`` and ``align``; return the slot count ``B`` (default ``M``)."""
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise PlanError(f"align must be an integer >= 1, got {align!r}")
    if slots is None:
        return max_local
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
        raise PlanError(f"slots must be an integer >= 0, got {slots!r}")
    return slots
