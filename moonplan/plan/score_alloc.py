"""A balancing candidate's predicted step time from its allocation, without laying it out.

Legend:
    R ranks, E experts, B slots
    counts_RE  int64 [R, E] validated router counts (host)
    prev_RB    int64 [R, B] previous plan's slots (``-1`` empty), or None
    prev_F3    int64 [R-1, 3] previous plan's flows, or None
    alloc_ER   int64 [E, R] the candidate's allocation
    fetch_ER   bool [E, R] pairs whose weights the candidate's plan moves this step

``policy="auto"`` scores a candidate with ``cost.plan_time(plan)``, which reads the
built plan's allocation, counts, home map and fetched pairs (``stepcost.step_cost
.plan_fetch_ER``: its new slots and its direct replicas). The fetched pairs follow
from the allocation and the previous slots alone: the slot placement
(``reference.place_slots``, ``torch_layout.place_slots_torch``,
``from_alloc.layout_torch``) keeps a replica that sits in one of its rank's previous
slots in that slot, and puts every other replica in a new slot or, past the free
slots, in a direct row. Both are fetched, so

    fetch_ER = (alloc_ER > 0) & (home_E != r) & ~(e in prev_RB[r])

whatever the slot budget ``B`` or the residents evicted (``tests/plan/test_search.py``
checks it against ``plan_fetch_ER`` of the built plans). So a candidate is scored by
``cost.step_time(alloc, counts, fetch, home)``: the plan's score, without its slots,
rows, offsets and ``Plan`` (about half a construction on the CPU).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moonplan.plan.home import home_list, home_map
from moonplan.plan.reference import reference_fields
from moonplan.plan.torch_backend import alloc_torch


def construction_alloc(
    counts_RE: torch.Tensor,
    prev: tuple[torch.Tensor | None, torch.Tensor | None],
    target: list[int] | None,
    backend: str,
) -> torch.Tensor:
    """int64 ``[E, R]``: the group-flow construction's allocation towards ``target``.

    ``prev``: ``(prev_RB, prev_F3)`` it replays (``(None, None)``: none); ``target``: the
    per-rank targets (``None``: exact balance); ``backend``: ``"torch"`` runs steps 1-2 of
    the torch builder only (``torch_backend.alloc_torch``, no slots and no rows), and
    ``"reference"`` the reference planner (the definition; it lays the plan out too).
    """
    prev_RB, prev_F3 = prev
    if backend == "reference":
        B = 0 if prev_RB is None else prev_RB.shape[1]
        fields = reference_fields(counts_RE, B, 1, prev, target=target, device=counts_RE.device)
        return fields["alloc"]
    target_R = None if target is None else torch.tensor(target, dtype=torch.int64)
    return alloc_torch(counts_RE, prev_RB, prev_F3, target_R=target_R)


def fetched_pairs(alloc_ER: torch.Tensor, prev_RB: torch.Tensor | None) -> np.ndarray:
    """bool ``[E, R]``: the replicas of ``alloc_ER`` not resident in ``prev_RB``'s slots
    (module docstring): what a plan of ``alloc_ER`` built on ``prev_RB`` fetches."""
    a_ER = alloc_ER.cpu().numpy()
    E, R = a_ER.shape
    fetch_ER = a_ER > 0
    fetch_ER[np.arange(E), np.asarray(home_list(E, R), dtype=np.int64)] = False
    if prev_RB is not None and prev_RB.numel():
        p_RB = prev_RB.cpu().numpy()
        r_N, j_N = (p_RB >= 0).nonzero()
        fetch_ER[p_RB[r_N, j_N], r_N] = False
    return fetch_ER


def alloc_time(
    cost: Any, counts_RE: torch.Tensor, alloc_ER: torch.Tensor, prev_RB: torch.Tensor | None,
    planned: int,
) -> Any:  # fmt: skip
    """``cost.step_time`` of a plan of ``alloc_ER`` built on ``prev_RB`` with ``planned``
    runs: ``cost.plan_time(plan, planned=planned)`` of that plan, without the plan."""
    E, R = alloc_ER.shape
    fetch_ER = torch.from_numpy(fetched_pairs(alloc_ER, prev_RB))
    return cost.step_time(alloc_ER, counts_RE, fetch_ER, home_map(E, R), planned=planned)
