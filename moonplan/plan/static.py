"""Static EP as a :class:`Plan`: every record runs on its expert's home rank (no balancing).

Legend: R ranks, E experts, B slots, M = ceil(E/R).

It is the baseline the runtime is measured against ("planning off"): the same
dispatch, experts and combine, with the loads the router happens to produce.
Its ``target`` is the static load, so it does not meet invariant 2.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.plan.home import home_map, max_local
from moonplan.plan.plan_type import Plan
from moonplan.plan.torch_layout import group_experts, row_layout_torch
from moonplan.plan.validate import as_counts, check_options


def static_plan(counts: Any, *, slots: int | None = None, align: int = 1) -> Plan:
    """The static-EP plan of ``counts [R, E]`` (same tensor shapes as :func:`moonplan.plan`)."""
    counts_RE = as_counts(counts)
    R, E = counts_RE.shape
    B = check_options(slots, align, max_local(E, R), counts_RE)
    dev = counts_RE.device
    home_E = home_map(E, R, device=dev)
    alloc_ER = torch.zeros(E, R, dtype=torch.int64, device=dev)
    alloc_ER[torch.arange(E, device=dev), home_E] = counts_RE.sum(0)
    M = max_local(E, R)
    slot_RB = torch.full((R, B), -1, dtype=torch.int64, device=dev)
    direct_RD = torch.full((R, max(0, M - B)), -1, dtype=torch.int64, device=dev)
    row_RW, count_RW, offset_RW1 = row_layout_torch(
        group_experts(E, R, dev), slot_RB, direct_RD, alloc_ER, align
    )
    F = max(R - 1, 0)
    return Plan(
        counts=counts_RE,
        alloc=alloc_ER,
        target=alloc_ER.sum(0),
        home=home_E,
        flow=torch.tensor([[-1, -1, 0]] * F, dtype=torch.int64, device=dev).view(F, 3),
        slot_expert=slot_RB,
        slot_new=torch.zeros_like(slot_RB),
        row_expert=row_RW,
        row_count=count_RW,
        row_offset=offset_RW1,
        num_slots=B,
        align=align,
        backend="static",
    )
