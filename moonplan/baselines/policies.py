"""A common interface for balancing policies, so that all run on the same counts.

Legend:
    R ranks    E experts    C weight copies moved in one step
    counts_RE  int64 records source rank ``s`` routes to expert ``e`` (one step, all-gathered)
    alloc_ER   int64 records of expert ``e`` that rank ``r`` executes (real records only)
    rows_ER    int64 rows rank ``r`` computes for expert ``e`` (``alloc_ER`` plus padding)
    sent_RE    int64 rows source ``s`` sends towards expert ``e`` (counts minus drops, plus padding)
    moves_C2   int64 ``(source rank, destination rank)`` of each expert-weight copy moved

A policy is an object with ``step(counts_RE) -> PolicyStep``; it may keep state
between steps (EPLB's history, moonplan's resident slots). ``reset()`` forgets it.
Policies here: static EP with linear or round-robin placement, the MoonEP greedy,
moonplan without and with resident slots (``previous=``), and moonplan's cost-aware
choice (``policy="auto"``, which needs the simulator's ``StepCost``). EPLB-style periodic
replication and Switch-style capacity live in ``eplb.py`` and ``capacity.py``;
:func:`make_policy` builds any of them by name.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.baselines.capacity import CapacityPolicy
from moonplan.baselines.eplb import EPLBPolicy
from moonplan.baselines.moonep_greedy import moonep_greedy_alloc
from moonplan.baselines.policy_base import Policy, PolicyStep, make_step, no_moves
from moonplan.baselines.round_robin import placement_alloc, round_robin_home
from moonplan.plan import api as planner
from moonplan.plan.home import home_map
from moonplan.plan.plan_type import Plan
from moonplan.stepcost import StepCost, plan_fetch_ER

__all__ = [
    "POLICY_NAMES",
    "GreedyPolicy",
    "MoonplanAutoPolicy",
    "MoonplanPolicy",
    "Policy",
    "PolicyStep",
    "StaticPolicy",
    "make_policy",
    "make_step",
    "no_moves",
    "replica_moves",
    "slot_moves",
]


class StaticPolicy(Policy):
    """Static EP: every record runs on its expert's only holder; no copies, no drops.

    ``placement="linear"`` (contiguous blocks, the first ``E mod R`` ranks one more:
    vLLM's default) or ``"round-robin"`` (expert ``e`` on rank ``e mod R``).
    """

    def __init__(self, num_ranks: int, num_experts: int, placement: str = "linear") -> None:
        super().__init__(num_ranks, num_experts)
        if placement == "linear":
            self.home_E = home_map(num_experts, num_ranks)
        elif placement == "round-robin":
            self.home_E = round_robin_home(num_experts, num_ranks)
        else:
            raise ValueError(f"unknown placement {placement!r}; use 'linear' or 'round-robin'")
        self.name = f"static-{placement}"

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        return make_step(self.name, counts_RE, placement_alloc(counts_RE, self.home_E))


class GreedyPolicy(Policy):
    """The upstream MoonEP greedy (``moonep_greedy_alloc``): exact balance, every replica
    re-copied from its home rank every step."""

    name = "moonep-greedy"

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        alloc_ER = moonep_greedy_alloc(counts_RE)
        home_E = home_map(self.num_experts, self.num_ranks)
        moves_C2 = replica_moves(alloc_ER, home_E)
        fetch_ER = (alloc_ER > 0) & (home_E[:, None] != torch.arange(self.num_ranks)[None, :])
        return make_step(
            self.name,
            counts_RE,
            alloc_ER,
            copies=moves_C2.shape[0],
            moves_C2=moves_C2,
            fetch_ER=fetch_ER,
            src_E=home_E,
        )


class MoonplanPolicy(Policy):
    """``moonplan.plan`` every step; with ``resident=True`` the last plan is passed as
    ``previous=`` so resident replicas are reused and only new slots move weights."""

    def __init__(
        self, num_ranks: int, num_experts: int, *, resident: bool = False, slots: int | None = None
    ) -> None:
        super().__init__(num_ranks, num_experts)
        self.resident = resident
        self.slots = slots
        self.name = "moonplan-resident" if resident else "moonplan"
        self._previous: Plan | None = None

    def reset(self) -> None:
        self._previous = None

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        prev = self._previous if self.resident else None
        p = planner.plan(counts_RE, slots=self.slots, previous=prev, backend="torch")
        self._previous = p
        return plan_step(self.name, counts_RE, p)


class MoonplanAutoPolicy(Policy):
    """``moonplan.plan(..., policy="auto", cost=cost)`` every step, the chosen plan kept as
    ``previous=`` (its resident slots are reused by the next step's candidates).

    ``cost`` is the :class:`~moonplan.stepcost.StepCost` the choice minimises; the
    simulator passes the one it charges the step with (same model, hardware, schedule
    and planning time), so the plan's predicted time is its simulated time. Planning is
    charged per planner run (``plan.planned``).
    """

    name = "moonplan-auto"

    def __init__(
        self, num_ranks: int, num_experts: int, *, cost: StepCost, slots: int | None = None
    ) -> None:
        super().__init__(num_ranks, num_experts)
        if not isinstance(cost, StepCost):
            raise ValueError(f"moonplan-auto needs cost=StepCost(...), got {cost!r}")
        self.cost = cost
        self.slots = slots
        self._previous: Plan | None = None

    def reset(self) -> None:
        self._previous = None

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        p = planner.plan(
            counts_RE,
            slots=self.slots,
            previous=self._previous,
            backend="torch",
            policy="auto",
            cost=self.cost,
        )
        self._previous = p
        return plan_step(self.name, counts_RE, p, planned=p.planned, choice=p.policy)


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


def replica_moves(alloc_ER: torch.Tensor, home_E: torch.Tensor) -> torch.Tensor:
    """``[C, 2]`` (home rank, rank) of every replica pair of ``alloc_ER`` (rank-major order)."""
    R = alloc_ER.shape[1]
    remote_ER = (alloc_ER > 0) & (home_E[:, None] != torch.arange(R)[None, :])
    r_C, e_C = remote_ER.t().nonzero(as_tuple=True)
    return torch.stack([home_E[e_C], r_C], dim=1)


def slot_moves(p: Plan) -> torch.Tensor:
    """``[C, 2]`` (home rank, rank) of every slot a plan fills this step (``slot_new``)."""
    r_C, j_C = (p.slot_new.cpu() > 0).nonzero(as_tuple=True)
    e_C = p.slot_expert.cpu()[r_C, j_C]
    return torch.stack([p.home.cpu()[e_C], r_C], dim=1)


POLICY_NAMES = (
    "static-linear",
    "static-round-robin",
    "capacity-1.0",
    "capacity-1.25",
    "eplb",
    "moonep-greedy",
    "moonplan",
    "moonplan-resident",
    "moonplan-auto",
)
"""Names understood by :func:`make_policy`, in report order."""


def make_policy(name: str, num_ranks: int, num_experts: int, **options: Any) -> Policy:
    """Build a policy by name (see :data:`POLICY_NAMES`).

    ``capacity-<f>`` accepts any factor ``f > 0`` (e.g. ``capacity-2.0``). ``options``
    go to the EPLB policy (``redundant``, ``period``, ``window``, ``nodes``, ``groups``)
    and to moonplan (``slots``; ``moonplan-auto`` also needs ``cost``, a
    :class:`~moonplan.stepcost.StepCost`); options that a policy does not take are ignored.
    """
    R, E = num_ranks, num_experts
    if name == "static-linear":
        return StaticPolicy(R, E, "linear")
    if name == "static-round-robin":
        return StaticPolicy(R, E, "round-robin")
    if name.startswith("capacity-"):
        capacity = CapacityPolicy(R, E, factor=_factor(name))
        capacity.name = name  # as asked: "capacity-2" stays "capacity-2"
        return capacity
    if name == "eplb":
        keys = ("redundant", "period", "window", "nodes", "groups")
        return EPLBPolicy(R, E, **{k: v for k, v in options.items() if k in keys})
    if name == "moonep-greedy":
        return GreedyPolicy(R, E)
    if name in ("moonplan", "moonplan-resident"):
        slots = options.get("slots")
        return MoonplanPolicy(R, E, resident=name.endswith("resident"), slots=slots)
    if name == "moonplan-auto":
        if options.get("cost") is None:
            raise ValueError("moonplan-auto needs cost=StepCost(...) (the model it minimises)")
        return MoonplanAutoPolicy(R, E, cost=options["cost"], slots=options.get("slots"))
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")


def _factor(name: str) -> float:
    try:
        factor = float(name.split("-", 1)[1])
    except ValueError:
        raise ValueError(f"bad capacity policy {name!r}; use e.g. capacity-1.25") from None
    if not factor > 0:
        raise ValueError(f"capacity factor must be > 0, got {factor}")
    return factor
