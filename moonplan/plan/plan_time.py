"""The step time a :class:`~moonplan.plan.Plan` predicts under a cost model.

Legend:
    R ranks    E experts
    alloc_ER  int64 records of expert ``e`` rank ``r`` executes (the step's rows)
    fetch_ER  bool pairs whose weights the plan moves this step (new slots, direct reads)

The cost model (``moonplan.stepcost``) sits below the planner and knows no ``Plan``:
:meth:`~moonplan.stepcost.StepCost.step_time` takes arrays. This module reads them
from a plan: its rows are the plan's records (``alloc``; ``align`` padding is not
modelled: it is small next to the GEMM tile), its sent rows the counts, its fetched
pairs the new slots and direct replicas, fetched from the experts' home ranks.
"""

from __future__ import annotations

import numpy as np
import torch

from moonplan.host_arrays import host_int64
from moonplan.plan.plan_type import Plan
from moonplan.stepcost.fetch_pairs import fetch_pairs_ER
from moonplan.stepcost.step_cost import StepCost, StepTime


def plan_time(cost: StepCost, plan: Plan, *, planned: float = 1) -> StepTime:
    """Predicted :class:`~moonplan.stepcost.StepTime` of ``plan`` under ``cost``
    (module docstring); ``planned``: planner calls charged on the critical path (the
    plan's own count is ``plan.planned``). The allocation is copied to the host once."""
    alloc_ER = host_int64(plan.alloc)
    fetch_ER = _fetch_ER(plan, alloc_ER)
    return cost.step_time(
        alloc_ER, host_int64(plan.counts), fetch_ER, host_int64(plan.home), planned=planned
    )


def plan_fetch_ER(plan: Plan, alloc_ER: np.ndarray | None = None) -> torch.Tensor:
    """CPU bool ``[E, R]``: pairs whose weights ``plan`` moves this step (new slots, direct
    reads). ``alloc_ER``: the plan's allocation already on the host (int64 numpy), if any."""
    return torch.from_numpy(
        _fetch_ER(plan, host_int64(plan.alloc) if alloc_ER is None else alloc_ER)
    )


def _fetch_ER(plan: Plan, alloc_ER: np.ndarray) -> np.ndarray:
    """:func:`plan_fetch_ER` as a numpy array (``alloc_ER``: the plan's, on the host)."""
    return fetch_pairs_ER(alloc_ER, plan.slot_expert, plan.slot_new, plan.direct_expert())
