"""How a layer runtime plans each step for its ``balance=`` mode, and its cost model.

Legend: R ranks, E experts, ``counts_RE`` int64 ``[R, E]`` records per source rank and expert.

* ``"off"``: ``static_plan`` (every record on its home rank);
* ``"exact"``: ``moonplan.plan`` (exact balance, the planner's default policy);
* ``"auto"``: ``moonplan.plan(..., policy="auto", cost=...)``: the candidate with the
  least predicted step time. The cost model is the user's ``cost=`` if given;
  otherwise the first :data:`WARMUP_STEPS` steps run ``"exact"`` and are measured
  (the very first step is not: it pays one-time allocation and page faults), then the
  runtime calibrates a :class:`~moonplan.stepcost.StepCost` from those steps
  (:mod:`moonplan.runtime.calibrate`, agreed across ranks) and plans ``"auto"`` from
  then on. ``layer.calibrate()`` does the same on demand.

Every rank counts the same steps (every rank runs every forward) and agrees on one
model, so every rank computes the same plan.
"""

from __future__ import annotations

from collections import deque

import torch

from moonplan.comm.group import EPGroup
from moonplan.plan import api as planner
from moonplan.plan.plan_type import Plan
from moonplan.plan.static import static_plan
from moonplan.runtime.balance import balance_mode
from moonplan.runtime.calibrate import StepSample, agree, fit_rates, sample_step
from moonplan.stepcost import StepCost

WARMUP_STEPS = 4
"""Measured exact steps before ``"auto"`` calibrates its own cost model."""

KEEP_SAMPLES = 32
"""Most recent step samples kept for ``calibrate()``."""


class Balancer:
    """Plans one layer's steps for a ``balance=`` mode (see the module docstring).

    Args:
        mode: ``"auto"``, ``"exact"`` or ``"off"``.
        slots: ``B``; align: receive-row padding.
        cost: a fixed cost model for ``"auto"`` (no calibration), or ``None``.
    """

    def __init__(self, mode: str, *, slots: int, align: int, cost: StepCost | None = None):
        self.mode = balance_mode(mode)
        self.B, self.align = slots, align
        self.cost = cost
        self.user_cost = cost is not None
        self.samples: deque[StepSample] = deque(maxlen=KEEP_SAMPLES)
        self.steps = 0  # forwards seen (every rank counts the same)

    def policy(self) -> str:
        """The planner policy of the next step: ``"static"``, ``"exact"`` or ``"auto"``."""
        if self.mode == "off":
            return "static"
        if self.mode == "exact" or self.cost is None:
            return "exact"
        return "auto"

    def plan(self, counts_RE: torch.Tensor, previous: Plan | None) -> Plan:
        """The step's plan (the same on every rank for the same counts)."""
        policy = self.policy()
        if policy == "static":
            return static_plan(counts_RE, slots=self.B, align=self.align)
        if policy == "exact":
            return planner.plan(counts_RE, slots=self.B, align=self.align, previous=previous)
        return planner.plan(
            counts_RE,
            slots=self.B,
            align=self.align,
            previous=previous,
            policy="auto",
            cost=self.cost,
        )

    def record(self, plan: Plan, rank: int, sent: int, phases: dict[str, float]) -> None:
        """Keep this step's measurements (every step but the first)."""
        self.steps += 1
        if self.steps > 1:
            self.samples.append(sample_step(plan, rank, sent, phases))

    def due(self) -> bool:
        """Whether ``"auto"`` should calibrate now (same answer on every rank)."""
        return self.mode == "auto" and self.cost is None and len(self.samples) >= WARMUP_STEPS

    def calibrate(self, group: EPGroup, *, copy_fallback_s: float, overlap: bool) -> StepCost:
        """Collective: fit this rank's rates, agree on the max, use it from now on."""
        ok = bool(self.samples)
        group.agree(ok, "no measured steps yet: run a few forward steps first", what="calibrate")
        mine = fit_rates(
            list(self.samples), copy_fallback_s=copy_fallback_s, align=self.align, overlap=overlap
        )
        self.cost = agree(group, mine)
        self.user_cost = False
        return self.cost
