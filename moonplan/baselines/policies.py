"""moonplan's own simulator policies: ``moonplan.plan`` every step, through one planner seam.

Legend:
    R ranks    E experts    B slots per rank    C slots filled this step    W window steps
    counts_RE  int64 ``[R, E]`` one step's all-gathered router counts
    moves_C2   int64 ``[C, 2]`` (home rank, rank) of each slot filled this step
    fetch_ER   bool ``[E, R]`` pairs whose weights are fetched before their rows run
    refill_ER  bool ``[E, R]`` pairs whose slots are refilled in the background

Every policy here is a :class:`PlannerPolicy`: each step it calls
``moonplan.plan(counts, slots=, previous=, policy=, cost=)``, the same call (and the
same ``counts, previous, cost -> Plan`` interface) the runtime's
``moonplan.runtime.balancer.Balancer`` makes, and turns the :class:`Plan` into a
:class:`PolicyStep` with :func:`plan_step`. A subclass only says which planner policy
it asks for and whether the last plan is passed on as ``previous=``:

* ``moonplan``: ``policy="exact"``, no ``previous`` (every replica copied every step);
* ``moonplan-resident``: ``policy="exact"`` with ``previous=`` (resident slots reused);
* ``moonplan-auto``: ``policy="auto"`` every step, with ``previous=`` and the
  simulator's :class:`~moonplan.stepcost.StepCost` as ``cost=`` (one planner call that
  chooses, charged as the runtime's call costs: ``moonplan.baselines.planner_time``);
* ``moonplan-refresh`` (a model of a runtime feature that does not exist yet, not
  listed by default): ``policy="resident"`` every step over slots refilled in the
  background every ``period`` steps from the exact plan of the last ``window`` steps'
  summed counts, copied beside the next steps (at most ``period``) when the cost model
  says it pays (:class:`MoonplanRefreshPolicy`).

A new planner policy (``plan(policy="<name>")``) reaches the simulator as one more
subclass and one registration (CONTRIBUTING.md, "Adding a planner policy").
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from moonplan.baselines.planner_time import auto_us, exact_us, exit_us
from moonplan.baselines.policy_base import Policy, PolicyStep, make_step
from moonplan.baselines.registry import PolicyInfo, register
from moonplan.plan import api as planner
from moonplan.plan.plan_time import plan_fetch_ER, plan_time
from moonplan.plan.plan_type import Plan
from moonplan.stepcost import StepCost

__all__ = [
    "MoonplanAutoPolicy",
    "MoonplanPolicy",
    "MoonplanRefreshPolicy",
    "PlannerPolicy",
    "plan_step",
    "refill_link_s",
    "slot_moves",
    "split_pairs",
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

    def plan(
        self,
        counts_RE: torch.Tensor,
        previous: Plan | None,
        policy: str | None = None,
        cost: Any = None,
    ) -> Plan:
        """The step's :class:`Plan` from ``counts``, ``previous`` and ``self.cost``: the
        same ``moonplan.plan`` call as ``Balancer.plan(counts_RE, previous)``
        (``policy``: instead of ``self.planner_policy``; ``cost``: instead of
        ``self.cost``)."""
        return planner.plan(
            counts_RE,
            slots=self.slots,
            previous=previous,
            backend="torch",
            policy=policy or self.planner_policy,
            cost=self.cost if cost is None else cost,
        )

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        p = self.plan(counts_RE, self._previous)
        self._previous = p if self.keep_previous else None
        return plan_step(self.name, counts_RE, p, planned=p.planned)


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
    """``policy="auto"`` every step: the runtime's one planner call, the plan of each step
    kept as ``previous=`` (its resident slots are reused by the next step's candidates).

    ``cost`` is the :class:`~moonplan.stepcost.StepCost` the choice minimises; the
    simulator passes the one it charges the step with (same model, hardware, schedule and
    planner times), so a plan's predicted time is its simulated time. Each step is charged
    one planner call (``cost.plan_s``), or the early exit's test alone (``cost.exit_s``)
    when it returned static EP without building anything: ``PolicyStep.planned`` is
    ``exit_s / plan_s`` then.
    """

    name = "moonplan-auto"
    planner_policy = "auto"

    def __init__(
        self, num_ranks: int, num_experts: int, *, cost: StepCost, slots: int | None = None
    ) -> None:
        if not isinstance(cost, StepCost):
            raise ValueError(f"moonplan-auto needs cost=StepCost(...), got {cost!r}")
        super().__init__(num_ranks, num_experts, slots=slots, cost=cost)

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        p = self.plan(counts_RE, self._previous)
        self._previous = p
        assert p.choice is not None  # an auto plan
        planned = 1.0
        if p.choice.early_exit():
            planned = self.cost.exit_s / self.cost.plan_s if self.cost.plan_s > 0 else 0.0
        return plan_step(self.name, counts_RE, p, planned=planned, choice=p.policy)


class MoonplanRefreshPolicy(PlannerPolicy):
    """Resident slots refilled in the background from a window of recent counts.

    A model of a schedule the runtime does not run (its slots are filled only on the
    critical path of the step that uses them, ``docs/runtime.md``): it says what such a
    refill would give. Every step builds ``policy="resident"`` over the current slots
    (no planner run, no fetch: as balanced as the resident replicas allow). After every
    ``period``-th step the exact plan of the counts summed over the last ``window`` steps
    (``previous=`` the slots it will replace, so residents stay) is made off the
    critical path (``background_plan``: its run, a trial plan and three scores). Its new slots are
    copied from the experts' homes into a second set of slots (the memory is not
    modelled) beside the next ``k`` steps, a ``1/k`` share beside each (``refill_ER``),
    and serve once all have arrived: ``k`` is the fewest shares (at most ``period``)
    whose link time (:func:`refill_link_s`) fits in the last step's experts phase as
    ``cost`` predicts it (the links' idle part). The refill is made only if it pays by
    ``cost``: the resident plan over the new slots, on the last step's counts, must
    save more over ``period`` steps than the shares would expose. The simulator charges
    each step's share: its link time beyond that step's experts phase is exposed
    (``moonplan.simulate.model_time``).
    """

    name = "moonplan-refresh"
    planner_policy = "resident"

    def __init__(
        self,
        num_ranks: int,
        num_experts: int,
        *,
        cost: StepCost,
        period: int = 4,
        window: int | None = None,
        slots: int | None = None,
    ) -> None:
        if not isinstance(cost, StepCost):
            raise ValueError(f"moonplan-refresh needs cost=StepCost(...), got {cost!r}")
        super().__init__(num_ranks, num_experts, slots=slots, cost=cost)
        self.period, self.window = int(period), int(window or period)
        if min(self.period, self.window) < 1:
            raise ValueError(f"period and window must be >= 1, got {period}, {window}")
        self.reset()

    def reset(self) -> None:
        self._previous = None  # the slots the steps execute over
        self._pending: Plan | None = None  # the slots being copied
        self._shares: list[torch.Tensor] = []  # refill_ER of each step still to copy
        self._history: deque[torch.Tensor] = deque(maxlen=self.window)
        self._t = 0  # steps seen

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        p = self.plan(counts_RE, self._previous)
        refill_ER = self._shares.pop(0) if self._shares else None
        if self._pending is not None and not self._shares:  # all copied: serve from now on
            self._previous, self._pending = self._pending, None
        self._history.append(counts_RE)
        self._t += 1
        background = 0.0
        if self._t % self.period == 0 and len(self._history) == self.window:
            window_RE = torch.stack(list(self._history)).sum(0)
            refill = planner.plan(
                window_RE, slots=self.slots, previous=self._previous, backend="torch"
            )
            self._shares = self._shares_if_paid(counts_RE, p, refill)
            self._pending = refill if self._shares else None
            # the refill's own run, the trial plan over the refilled slots (one run) and
            # three predictions (now, the refill's link time, after)
            background = refill.planned + 1  # the refill's run and the trial plan
        return plan_step(
            self.name, counts_RE, p, planned=p.planned, background_plan=background,
            refill_ER=refill_ER,
        )  # fmt: skip

    def _shares_if_paid(self, counts_RE: torch.Tensor, p: Plan, refill: Plan) -> list[torch.Tensor]:
        """The refill's pairs in the fewest shares (at most ``period``) whose link time fits
        in ``p``'s experts phase; none (no refill) unless the refilled slots, over this
        step's counts, save more in ``period`` steps than the shares would expose."""
        refill_ER = plan_fetch_ER(refill)
        if not refill_ER.any():  # nothing to copy: no trial plan needed
            return []
        now = plan_time(self.cost, p, planned=0)
        link_s = refill_link_s(self.cost, refill_ER, p.home.cpu())
        k = self.period if now.experts_s <= 0 else math.ceil(link_s / now.experts_s)
        k = max(1, min(self.period, k))
        after = plan_time(self.cost, self.plan(counts_RE, refill), planned=0)
        exposed_s = k * max(0.0, link_s / k - now.experts_s)
        if (now.total_s - after.total_s) * self.period <= exposed_s:
            return []
        return split_pairs(refill_ER, k)


def refill_link_s(cost: StepCost, refill_ER: torch.Tensor, src_E: torch.Tensor) -> float:
    """Seconds the copies of ``refill_ER`` (bool ``[E, R]``, each from ``src_E[e]``) take
    alone on the links: ``cost``'s fetch of those pairs in a step with no rows (``cost``
    with ``dispatch="record"``: no rows, no dispatch traffic needed)."""
    if not bool(refill_ER.any()):
        return 0.0
    E, R = refill_ER.shape
    none_ER = torch.zeros(E, R, dtype=torch.int64)
    none_RE = torch.zeros(R, E, dtype=torch.int64)
    return float(cost.step_time(none_ER, none_RE, refill_ER, src_E, planned=0).prefetch_s)


def split_pairs(pairs_ER: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``parts`` bool ``[E, R]`` masks splitting the pairs of ``pairs_ER`` round-robin (in
    ``(e, r)`` order): their sizes differ by at most one, their union is ``pairs_ER``."""
    e_C, r_C = pairs_ER.nonzero(as_tuple=True)
    out = []
    for k in range(parts):
        part = torch.zeros_like(pairs_ER)
        part[e_C[k::parts], r_C[k::parts]] = True
        out.append(part)
    return out


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
        raise ValueError(f"{name} needs cost=StepCost(...) (the model it minimises)")
    return MoonplanAutoPolicy(num_ranks, num_experts, **options)


def _refresh(name: str, num_ranks: int, num_experts: int, **options: Any) -> Policy:
    if options.get("cost") is None:
        raise ValueError(f"{name} needs cost=StepCost(...) (to time its refill)")
    return MoonplanRefreshPolicy(num_ranks, num_experts, **options)


# Both exact variants take `slots`; auto also needs `cost` (the StepCost it minimises).
register(PolicyInfo("moonplan", _moonplan, style=("-", "o"), plan_us=exact_us,
                    options=("slots",), order=60))  # fmt: skip
register(PolicyInfo("moonplan-resident", _moonplan, label="resident", style=("-", "D"),
                    plan_us=exact_us, options=("slots",), order=70))  # fmt: skip
register(PolicyInfo("moonplan-auto", _auto, label="auto", plan_us=auto_us, exit_us=exit_us,
                    options=("cost", "slots"), order=80))  # fmt: skip
# Background slot refresh: modelled, not in the runtime; not listed (docs/simulator.md).
register(PolicyInfo("moonplan-refresh", _refresh, label="refresh", style=(":", "v"),
                    plan_us=exact_us, options=("cost", "period", "window", "slots"),
                    order=100, listed=False))  # fmt: skip
