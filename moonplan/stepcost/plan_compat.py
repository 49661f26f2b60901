"""Deprecated: the cost model's old entry points that took a plan (removed next release).

Legend:
    R ranks    E experts    B prefetch slots per rank    D direct-read rows per rank

``StepCost.plan_time(plan)`` and ``moonplan.stepcost.plan_fetch_ER(plan)`` moved to
``moonplan.plan.plan_time`` (``plan_time(cost, plan)``, ``plan_fetch_ER(plan)``): the
cost model sits below the planner and imports nothing of it. Until they go, the old
names warn and read the few tensors they need through :class:`PlanTensors`, a
Protocol that ``moonplan.plan.Plan`` meets, so no import runs back up to the planner.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import numpy as np
import torch

from moonplan.host_arrays import host_int64
from moonplan.stepcost.fetch_pairs import fetch_pairs_ER


class PlanTensors(Protocol):
    """The tensors of a plan the old entry points read (``moonplan.plan.Plan``'s)."""

    @property
    def alloc(self) -> torch.Tensor:
        """int64 ``[E, R]`` records of expert ``e`` rank ``r`` executes."""

    @property
    def counts(self) -> torch.Tensor:
        """int64 ``[R, E]`` records source ``s`` routes to expert ``e``."""

    @property
    def home(self) -> torch.Tensor:
        """int64 ``[E]`` home rank of each expert."""

    @property
    def slot_expert(self) -> torch.Tensor:
        """int64 ``[R, B]`` expert of each prefetch slot, ``-1``: empty."""

    @property
    def slot_new(self) -> torch.Tensor:
        """int64 ``[R, B]`` 1 where the slot is (re)filled this step."""

    def direct_expert(self) -> torch.Tensor:
        """int64 ``[R, D]`` replicas read in place from the home rank, ``-1``: none."""


def warn_moved(old: str, new: str) -> None:
    """The DeprecationWarning of an old entry point ``old`` that ``new`` replaces."""
    warnings.warn(
        f"{old} is deprecated: use {new} (moonplan.plan.plan_time); it goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )


def step_inputs(plan: PlanTensors) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(rows_ER, sent_RE, fetch_ER, src_E)`` of ``plan`` on the host, as
    ``StepCost.step_time`` takes them (``moonplan.plan.plan_time``'s reading)."""
    alloc_ER = host_int64(plan.alloc)
    fetch_ER = fetch_pairs_ER(alloc_ER, plan.slot_expert, plan.slot_new, plan.direct_expert())
    return alloc_ER, host_int64(plan.counts), fetch_ER, host_int64(plan.home)


def plan_fetch_ER(plan: PlanTensors, alloc_ER: np.ndarray | None = None) -> torch.Tensor:
    """Deprecated: ``moonplan.plan.plan_time.plan_fetch_ER`` (the same arguments)."""
    warn_moved("moonplan.stepcost.plan_fetch_ER(plan)", "plan_fetch_ER(plan)")
    alloc = host_int64(plan.alloc) if alloc_ER is None else alloc_ER
    slots = (plan.slot_expert, plan.slot_new, plan.direct_expert())
    return torch.from_numpy(fetch_pairs_ER(alloc, *slots))
