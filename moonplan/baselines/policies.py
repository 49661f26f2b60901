"""moonplan's own simulator policies: ``moonplan.plan`` every step, through one planner seam.

Legend:
    R ranks    E experts    B slots per rank    C slots filled this step
    counts_RE  int64 ``[R, E]`` one step's all-gathered router counts
    moves_C2   int64 ``[C, 2]`` (home rank, rank) of each slot filled this step
    fetch_ER   bool ``[E, R]`` pairs whose weights are fetched before their rows run

Every policy here is a :class:`PlannerPolicy`: each step it calls
``moonplan.plan(counts, slots=, previous=, policy=, cost=)``, the same call (and the
same ``counts, previous, cost -> Plan`` interface) the runtime's
``moonplan.runtime.balancer.Balancer`` makes, and turns the :class:`Plan` into a
:class:`PolicyStep` with :func:`plan_step`. A subclass only says which planner policy
it asks for and whether the last plan is passed on as ``previous=``:

* ``moonplan``: ``policy="exact"``, no ``previous`` (every replica copied every step);
* ``moonplan-resident``: ``policy="exact"`` with ``previous=`` (resident slots reused);
* ``moonplan-auto``: ``policy="auto"`` with ``previous=`` and the simulator's
  :class:`~moonplan.stepcost.StepCost` as ``cost=``.

A new planner policy (``plan(policy="<name>")``) reaches the simulator as one more
subclass and one registration (CONTRIBUTING.md, "Adding a planner policy").
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.baselines.moonep_greedy import MOONEP_PLAN_US
from moonplan.baselines.policy_base import Policy, PolicyStep, make_step
from moonplan.baselines.registry import PolicyInfo, register
from moonplan.plan import api as planner
from moonplan.plan.plan_type import Plan
from moonplan.stepcost import StepCost, plan_fetch_ER

__all__ = [
    "MoonplanAutoPolicy",
    "MoonplanPolicy",
    "PlannerPolicy",
    "plan_step",
    "slot_moves",
]


class PlannerPolicy(Policy):
    """``moonplan.plan(counts, slots=, previous=, policy=, cost=)`` every step.

    Class attributes a subclass sets: ``planner_policy`` (the ``policy=`` of
    ``moonplan.plan``) and ``keep_previous`` (pass the last plan as ``previous=``).
    ``cost`` is the cost model ``policy="auto"`` minimises (``None`` otherwise).
    """

    planner_policy = "exact"
    keep_previous = True

    def __init__(
        self, num_ranks: int, num_experts: int, *, slots: int | None = None, cost: Any = None
    ) -> None:
        super().__init__(num_ranks, num_experts)
        self.slots = slots
        self.cost = cost
        self._previous: Plan | None = None

    def reset(self) -> None:
        self._previous = None

    def plan(self, counts_RE: torch.Tensor, previous: Plan | None) -> Plan:
        """The step's :class:`Plan` from ``counts``, ``previous`` and ``self.cost``: the
        same ``moonplan.plan`` call as ``Balancer.plan(counts_RE, previous)``."""
        return planner.plan(
            counts_RE,
            slots=self.slots,
            previous=previous,
            backend="torch",
            policy=self.planner_policy,
            cost=self.cost,
        )

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        p = self.plan(counts_RE, self._previous)
        self._previous = p if self.keep_previous else None
        choice = p.policy if self.planner_policy == "auto" else ""
        # charged: the constructions run plus the choice's own work (0 unless chosen)
        return plan_step(self.name, counts_RE, p, planned=p.planned + p.chose, choice=choice)


class MoonplanPolicy(PlannerPolicy):
    """Exact balance every step; with ``resident=True`` the last plan is passed as
    ``previous=`` so resident replicas are reused and only new slots move weights."""

    def __init__(
        self, num_ranks: int, num_experts: int, *, resident: bool = False, slots: int | None = None
    ) -> None:
        super().__init__(num_ranks, num_experts, slots=slots)
        self.keep_previous = resident
        self.name = "moonplan-resident" if resident else "moonplan"


class MoonplanAutoPolicy(PlannerPolicy):
    """``moonplan.plan(..., policy="auto", cost=cost)`` every step, the chosen plan kept as
    ``previous=`` (its resident slots are reused by the next step's candidates).

    ``cost`` is the :class:`~moonplan.stepcost.StepCost` the choice minimises; the
    simulator passes the one it charges the step with (same model, hardware, schedule
    and planning time), so the plan's predicted time is its simulated time. Planning is
    charged per planner run (``plan.planned``) plus the choice's own work (screens,
    scorings, the keep test: ``plan.chose``, in construction equivalents measured on this
    code, ``moonplan.plan.choose.WORK``).
    """

    name = "moonplan-auto"
    planner_policy = "auto"

    def __init__(
        self, num_ranks: int, num_experts: int, *, cost: StepCost, slots: int | None = None
    ) -> None:
        if not isinstance(cost, StepCost):
            raise ValueError(f"moonplan-auto needs cost=StepCost(...), got {cost!r}")
        super().__init__(num_ranks, num_experts, slots=slots, cost=cost)


def plan_step(name: str, counts_RE: torch.Tensor, p: Plan, **options: Any) -> PolicyStep:
    """The :class:`PolicyStep` of a moonplan plan: its slots' moves and fetched pairs."""
    return make_step(
        name,
        counts_RE,
        p.alloc,
        copies=p.copies(),
        moves_C2=slot_moves(p),
        fetch_ER=plan_fetch_ER(p),
        src_E=p.home.cpu(),
        **options,
    )


def slot_moves(p: Plan) -> torch.Tensor:
    """``moves_C2`` of every slot a plan fills this step (``slot_new``)."""
    r_C, j_C = (p.slot_new.cpu() > 0).nonzero(as_tuple=True)
    e_C = p.slot_expert.cpu()[r_C, j_C]
    return torch.stack([p.home.cpu()[e_C], r_C], dim=1)


def _moonplan(name: str, num_ranks: int, num_experts: int, **options: Any) -> Policy:
    return MoonplanPolicy(num_ranks, num_experts, resident=name.endswith("resident"), **options)


def _auto(name: str, num_ranks: int, num_experts: int, **options: Any) -> Policy:
    if options.get("cost") is None:
        raise ValueError("moonplan-auto needs cost=StepCost(...) (the model it minimises)")
    return MoonplanAutoPolicy(num_ranks, num_experts, **options)


# Both exact variants take `slots`; auto also needs `cost` (the StepCost it minimises).
register(PolicyInfo("moonplan", _moonplan, style=("-", "o"), plan_us=MOONEP_PLAN_US,
                    options=("slots",), order=60))  # fmt: skip
register(PolicyInfo("moonplan-resident", _moonplan, label="resident", style=("-", "D"),
                    plan_us=MOONEP_PLAN_US, options=("slots",), order=70))  # fmt: skip
register(PolicyInfo("moonplan-auto", _auto, label="auto", plan_us=MOONEP_PLAN_US,
                    options=("cost", "slots"), order=80))  # fmt: skip
