"""The runtime's side of replicas that stay: watch the steps, order refills when they pay.

Legend: R ranks, E experts, B slots per rank, S staging rows per rank.

With ``balance="auto"`` and a cost model, every step's counts go to a
:class:`~moonplan.plan.residency.refill.Residency` (the simulator's ``moonplan-auto`` runs
the same one, under the same :class:`~moonplan.plan.residency.refill.Decisions` rule). A
decision (which slot table the window's loads want, and whether rent or buy says a refill
pays) starts from a snapshot of one step, runs on a worker thread beside the next ``k``
steps and is used ``k`` steps later (the step waits for it only if it is not done); ``k``
is the fewest steps whose predicted time covers its work (the builds of the ``resident``
candidate it makes and the (step, table) pairs it scores, counted as it runs, at the
host's rates ``cost.decide_s`` and ``cost.score_s``, which the calibration times:
``moonplan.plan.residency.work``). Every input is agreed (the
counts, the cost model, the plans), so every rank decides alike at the same step and hands
the same target to :meth:`~moonplan.runtime.layer_runtime.LayerRuntime.request_refill`.
The snapshot is taken on the device; the worker reads it on the host.

While refills run in the background, each step's planner call buys only what pays in that
step (``moonplan.plan(..., rent=False)``): the slots for later steps are the refill's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from moonplan.plan.plan_type import Plan
from moonplan.plan.residency.refill import Decisions, Residency
from moonplan.stepcost import StepCost


class Placer:
    """One layer's residency and its decisions (module docstring).

    Args:
        num_slots: ``B``; staging: ``S`` (no refill without both).
    """

    def __init__(self, num_slots: int, staging: int):
        self.B, self.S = num_slots, staging
        self.decisions: Decisions | None = None
        self.orders = 0  # refills ordered
        self._worker: ThreadPoolExecutor | None = None

    @property
    def residency(self) -> Residency | None:
        """The residency (``None`` until the first step with a cost model)."""
        return None if self.decisions is None else self.decisions.residency

    def active(self, cost: StepCost | None) -> bool:
        """Whether refills are placed (``auto`` with a cost model, slots and staging)."""
        return cost is not None and self.B >= 1 and self.S >= 1

    def after_step(
        self, counts_RE: torch.Tensor, plan: Plan, cost: StepCost | None, busy: bool
    ) -> torch.Tensor | None:
        """Observe a finished step (its counts and plan, whose slots now serve); the
        refill target ``[R, B]`` to request now (``-1``: keep), or ``None`` (``busy``: a
        refill is in flight, no decision starts)."""
        if not self.active(cost):
            return None
        assert cost is not None
        if self.decisions is None:
            R, E = counts_RE.shape
            res = Residency(R, E, self.B, cost, staging=self.S, device=counts_RE.device)
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="moonplan-placer")
            self.decisions = Decisions(res, self._worker.submit)
        self.decisions.residency.cost = cost  # a calibration may have replaced it
        order = self.decisions.step(counts_RE, plan, busy)
        if order is None:
            return None
        self.orders += 1
        return torch.where(order.changed_RB, order.slot_RB, -1)

    def close(self) -> None:
        """Wait for a decision in flight and stop the worker."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
