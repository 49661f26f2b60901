"""The runtime's side of replicas that stay: watch the steps, order refills when they pay.

Legend: R ranks, E experts, B slots per rank, S staging rows per rank.

With ``balance="auto"`` and a cost model, every step's counts go to a
:class:`~moonplan.plan.residency.refill.Residency` (the simulator's ``moonplan-auto`` runs
the same one). A decision (which slot table the window's loads want, and whether rent or
buy says a refill pays) is made once its work fits beside the steps since the last one:
every ``k`` steps, ``k`` the fewest steps whose predicted time covers ``B + 3`` builds of
the ``resident`` candidate, each charged the cost model's early exit (``exit_s``, which
the calibration times with that build in it). Every input is agreed (the counts, the cost
model, the plans), so every rank decides alike at the same step and hands the same target
to :meth:`~moonplan.runtime.layer_runtime.LayerRuntime.request_refill`. The decision runs
on the host at the step it is due.

While refills run in the background, each step's planner call buys only what pays in that
step (``moonplan.plan(..., rent=False)``): the slots for later steps are the refill's.
"""

from __future__ import annotations

import math

import torch

from moonplan.plan.plan_time import plan_time
from moonplan.plan.plan_type import Plan
from moonplan.plan.residency.refill import Residency
from moonplan.stepcost import StepCost


class Placer:
    """One layer's residency and its decision cadence (module docstring).

    Args:
        num_slots: ``B``; staging: ``S`` (no refill without both).
    """

    def __init__(self, num_slots: int, staging: int):
        self.B, self.S = num_slots, staging
        self.residency: Residency | None = None
        self.since = 0  # steps observed since the last decision
        self.due = 1  # steps between decisions, set at each decision
        self.orders = 0  # refills ordered

    def active(self, cost: StepCost | None) -> bool:
        """Whether refills are placed (``auto`` with a cost model, slots and staging)."""
        return cost is not None and self.B >= 1 and self.S >= 1

    def after_step(
        self, counts_RE: torch.Tensor, plan: Plan, cost: StepCost | None, busy: bool
    ) -> torch.Tensor | None:
        """Observe a finished step (its counts and plan, whose slots now serve); the
        refill target ``[R, B]`` to request now, or ``None`` (``busy``: a refill is in
        flight, decide later)."""
        if not self.active(cost):
            return None
        assert cost is not None
        R, E = counts_RE.shape
        if self.residency is None:
            self.residency = Residency(R, E, self.B, cost, staging=self.S, device=counts_RE.device)
        self.residency.cost = cost  # a calibration may have replaced it
        self.residency.observe(counts_RE)  # on the device: no host read
        self.since += 1
        if busy or self.since < self.due:
            return None
        step_s = plan_time(cost, plan, planned=0).total_s  # host reads: decisions only
        work_s = self.residency.work() * cost.exit_s
        self.due = max(1, math.ceil(work_s / step_s)) if step_s > 0 else 1
        if self.since < self.due:
            return None
        order = self.residency.decide(counts_RE, plan.slot_expert, self.since)
        self.since = 0
        if order is None:
            return None
        self.orders += 1
        return order.slot_RB
