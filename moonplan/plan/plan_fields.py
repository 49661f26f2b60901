"""The layout tensors every planner backend builds: :class:`PlanFields`.

Legend:
    R ranks    E experts    B prefetch slots per rank    M = ceil(E/R)
    W = M + max(B, M) rows per rank    F = max(R - 1, 0) flow rows

Every builder returns one :class:`PlanFields` (the reference and ``Plan.from_alloc``
layouts, the torch, host and CUDA backends, static EP, the four forms of the ``auto``
choice); ``plan_type.make_plan`` adds the counts and the scalars to make a ``Plan``.
The row layout the fields describe is in ``plan_type.py``'s docstring.

A leaf: it imports nothing from moonplan, so any builder may import it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class PlanFields(NamedTuple):
    """A plan's layout tensors, all int64 on one device; their shapes depend only on
    ``(R, E, B)``. The names and order are ``Plan``'s tensor attributes after ``counts``."""

    alloc: torch.Tensor
    """``[E, R]`` records of expert ``e`` executed on rank ``r``."""
    target: torch.Tensor
    """``[R]`` records each rank executes (the planner's targets, ``alloc.sum(0)``)."""
    home: torch.Tensor
    """``[E]`` home rank of each expert."""
    flow: torch.Tensor
    """``[F, 3]`` the group flows ``(donor, receiver, records)`` in decision order, then
    ``(-1, -1, 0)`` padding."""
    slot_expert: torch.Tensor
    """``[R, B]`` expert held by each prefetch slot, ``-1`` if empty."""
    slot_new: torch.Tensor
    """``[R, B]`` 1 where the slot is (re)filled this step, else 0."""
    row_expert: torch.Tensor
    """``[R, W]`` expert of each row (home rows, slots, direct replicas), ``-1`` if empty."""
    row_count: torch.Tensor
    """``[R, W]`` records of each row (0 for empty rows)."""
    row_offset: torch.Tensor
    """``[R, W + 1]`` ``align``-padded row offsets (cu_seqlens)."""

    def to(self, device: torch.device) -> PlanFields:
        """The same fields with every tensor on ``device`` (one copy each, if elsewhere)."""
        return PlanFields(*(t.to(device) for t in self))


def padded_flows(
    flows: list[tuple[int, int, int]], num_ranks: int, device: torch.device | None = None
) -> torch.Tensor:
    """int64 ``[F, 3]`` on ``device`` (default: the CPU): host ``flows`` in decision order
    (at most ``F``), then ``(-1, -1, 0)`` padding rows."""
    F = max(num_ranks - 1, 0)
    rows = np.array(flows + [(-1, -1, 0)] * (F - len(flows)), dtype=np.int64).reshape(F, 3)
    flow_F3 = torch.from_numpy(rows)  # via numpy: half the host cost of torch.tensor(list)
    return flow_F3 if device is None else flow_F3.to(device)


def no_flows(num_ranks: int, device: torch.device) -> torch.Tensor:
    """int64 ``[F, 3]`` of padding rows ``(-1, -1, 0)`` only, built on ``device`` (no host
    copy: a CUDA graph may capture it)."""
    flow_F3 = torch.full((max(num_ranks - 1, 0), 3), -1, dtype=torch.int64, device=device)
    flow_F3[:, 2].fill_(0)
    return flow_F3
