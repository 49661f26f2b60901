"""moonplan's own simulator policies: ``moonplan.plan`` every step, through one planner seam.

Legend:
    R ranks    E experts    B slots per rank    C slots filled this step
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
  chooses, charged as the runtime's call costs: ``moonplan.baselines.planner_time``),
  over slots placed from a window of loads and refilled beside the steps
  (:mod:`moonplan.plan.residency`).

A new planner policy (``plan(policy="<name>")``) reaches the simulator as one more
subclass and one registration (CONTRIBUTING.md, "Adding a planner policy").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from moonplan.baselines.decision_time import decision_build_us, decision_score_us
from moonplan.baselines.planner_time import (
    ROUND_US,
    auto_us,
    exact_us,
    exit_us,
)
from moonplan.baselines.policy_base import Policy, PolicyStep, make_step
from moonplan.baselines.prehistory import Prehistory
from moonplan.baselines.registry import PolicyInfo, register
from moonplan.checks import check_int
from moonplan.plan import api as planner
from moonplan.plan.choice.rent import call_rounds_s, exit_rounds_s
from moonplan.plan.home import max_local
from moonplan.plan.home_order import check_order
from moonplan.plan.plan_time import plan_fetch_ER, plan_time
from moonplan.plan.plan_type import Plan
from moonplan.plan.residency.exact_way import EXACT, exact_charge_s
from moonplan.plan.residency.home_choice import HomeOffer, judged_order
from moonplan.plan.residency.refill import (
    STAGING,
    Decisions,
    Refill,
    Residency,
    refill_link_s,
    rehome_link_s,
    swapped_slots,
)
from moonplan.plan.residency.serving import empty_slots, lookup_way, serving_plan
from moonplan.plan.residency.window import WINDOW
from moonplan.stepcost import StepCost

__all__ = [
    "MoonplanAutoPolicy",
    "MoonplanPolicy",
    "PlannerPolicy",
    "plan_step",
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
    rent = True  # policy="auto": buy copies that pay over later steps (rent or buy)
    stale_slots = False  # training: every step changes the home weights, no slot outlives it

    def __init__(
        self, num_ranks: int, num_experts: int, *, slots: int | None = None, cost: Any = None
    ) -> None:
        super().__init__(num_ranks, num_experts)
        self.slots = slots
        self.cost = cost
        self._previous: Plan | None = None

    def reset(self) -> None:
        self._previous = None

    @property
    def serving(self) -> Plan | None:
        """The plan whose slots serve the next step (``None``: none yet)."""
        return self._previous

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
        ``self.cost``). With ``stale_slots`` (training traces) ``previous`` is dropped: the
        runtime's slots go stale at every optimizer step."""
        return planner.plan(
            counts_RE,
            slots=self.slots,
            previous=None if self.stale_slots else previous,
            backend="torch",
            policy=policy or self.planner_policy,
            cost=self.cost if cost is None else cost,
            rent=self.rent,
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
        self,
        num_ranks: int,
        num_experts: int,
        *,
        resident: bool = False,
        slots: int | None = None,
        stale_slots: bool = False,
    ) -> None:
        super().__init__(num_ranks, num_experts, slots=slots)
        self.keep_previous, self.stale_slots = resident, bool(stale_slots)
        self.name = "moonplan-resident" if resident else "moonplan"


class MoonplanAutoPolicy(PlannerPolicy):
    """``policy="auto"`` every step over slots that follow a window of loads.

    Each step is the runtime's one planner call, ``previous=`` the slots serving (the last
    plan's, or the refilled ones): the candidates balance inside the resident replicas
    first and copy more only where the cost model says it pays this step. Beside the
    steps, a :class:`~moonplan.plan.residency.refill.Residency` keeps the last
    ``placement_window`` steps' loads, picks the slot table the cost model prefers over
    them and orders a refill when rent or buy says it pays. Every slot serves: the
    ``staging`` rows per rank that a refill copies into are shared by the model's
    ``layers`` MoE layers, one refill at a time, first come first served
    (:mod:`moonplan.runtime.staging`), so a refill waits for its turn first. The simulator
    runs one layer and charges the worst turn: every other layer refills at the same
    moments, for as long, and goes first
    (``(layers - 1) * n`` steps of waiting, ``n`` the steps of its own copies; the other
    layers' copies are not on the links of this layer's steps, as no other layer's traffic
    is). The copies then run beside the next steps (``refill_ER``, a share per step whose
    link time fits in its experts phase) and serve from the step after the last one,
    swapped in on the critical path (``local_copies``).

    ``cost`` is the :class:`~moonplan.stepcost.StepCost` the choice minimises; the
    simulator passes the one it charges the step with, so a plan's predicted time is its
    simulated time. Each step is charged one planner call (``cost.plan_s``), or, when it
    exited, the early exit's test (``cost.exit_s``), and the rounds of the ``resident``
    build the call ran (``cost.round_s`` each, ``Choice.rounds``: ``planner_time.ROUND_US``,
    which ``SimConfig.step_cost`` sets for this policy). The placement's
    decisions follow the runtime's rule (:class:`~moonplan.plan.residency.refill.Decisions`:
    each runs on the host beside the ``k`` steps its work covers (on the decision thread
    every layer shares: with layers alike, the ``k`` steps of one layer bound that queue,
    :mod:`moonplan.runtime.placer`), the builds of the
    ``resident`` candidate it makes at ``cost.decide_s`` and the (step, table) pairs it
    scores without one at ``cost.score_s``, which ``SimConfig.step_cost`` sets from
    ``moonplan.baselines.decision_time``, and is used after them; no device time).
    The serving table at step 0 is the target of the ``placement_window`` steps before the
    trace (:meth:`prime`), as EPLB's placement is, served the way a decision judges for it
    kept (``Residency.prime``).

    Home orders (``moonplan.plan.residency.home_choice``): the policy relabels every
    step's counts (label ``i`` is expert ``home_order[i]``), as the runtime relabels the
    router's ids, and plans, places and is timed in labels. ``home_order=None`` starts on
    the linear map; with ``rehome`` (the runtime's ``MoEConfig.rehome``, on by default)
    it re-homes as the runtime does. Where the slots go stale (training), whenever its
    decisions' rent or buy offers an order (``Decisions.take_home``), the move's link time
    charged to the next step (:meth:`_take_home`). Serving, it takes, once,
    ``judged_order`` of its first window:
    that of :meth:`prime` (judged as before a trace: best tables), else at the first step
    after ``placement_window`` steps (judged against its serving slots; the slots then
    empty and the decisions take the new labels, their window's loads kept, as the
    runtime's; the rows' move is not charged: it is made once, inside a recorded trace's
    warm-up). ``home_order`` a permutation: fixed;
    ``"profile"`` (``moonplan-auto-ordered``: a user's ``rehome_model(model, "profile")``,
    in training too): ``judged_order`` of :meth:`prime`'s window or of ``profile`` (int64
    ``[S, E]`` per-step loads, for a trace without steps before it, judged for a layer
    whose slots are empty).
    """

    name = "moonplan-auto"
    planner_policy = "auto"

    def __init__(
        self,
        num_ranks: int,
        num_experts: int,
        *,
        cost: StepCost,
        slots: int | None = None,
        placement_window: int = WINDOW,
        staging: int = STAGING,
        layers: int = 1,
        stale_slots: bool = False,
        home_order: Sequence[int] | str | None = None,
        profile: torch.Tensor | None = None,
        rehome: bool = True,
    ) -> None:
        if not isinstance(cost, StepCost):
            raise ValueError(f"moonplan-auto needs cost=StepCost(...), got {cost!r}")
        self.stale_slots = bool(stale_slots)
        self.profiled = isinstance(home_order, str)  # the order waits for prime()'s window
        if self.profiled and home_order != PROFILE:
            raise ValueError(f"home_order must be a permutation, {PROFILE!r} or None, "
                             f"got {home_order!r}")  # fmt: skip
        if home_order is not None and not self.profiled:
            self.home_order = tuple(check_order(home_order, num_experts))
        total = max_local(num_experts, num_ranks) if slots is None else int(slots)
        self.staging = min(int(staging), total)
        self.rent = not self.staging  # the background refill buys for later steps
        super().__init__(num_ranks, num_experts, slots=total, cost=cost)
        self.window = int(placement_window)
        self.layers = check_int("layers", layers, 1)
        # the runtime's own re-home (MoEConfig.rehome): serving, once, from its first
        # window; training, whenever its decisions' rent or buy says (move_bytes)
        self._own = bool(rehome) and home_order is None and not self.stale_slots
        self.move_bytes = TRAINING_MOVE_BYTES if rehome and self.stale_slots else 0.0
        self._blocking_s = 0.0  # a re-home's rows, charged to the next step
        self._undo: list[tuple[int, ...] | None] = []  # the order before the first of them
        self._seen: list[torch.Tensor] = []  # the first window's loads (its own re-home)
        self.reset()
        if self.profiled and profile is not None:
            assert self.slots is not None
            judged = self._judged(profile, empty_slots(num_ranks, self.slots))
            self.home_order = self._chosen(judged)

    def _judged(self, loads_SE: torch.Tensor, serving_RB: torch.Tensor | None) -> HomeOffer | None:
        """The judgement of ``rehome("profile")`` on the steps ``loads_SE`` (int64
        ``[S, E]``, by expert) against the slots ``serving_RB`` (``None``: before a trace;
        where the slots go stale, training: with no slot kept either way):
        ``home_choice.judged_order``. Judged once."""
        assert self.slots is not None
        self.rehome = False
        return judged_order(self.cost, loads_SE, self.num_ranks, self.slots, serving_RB,
                            stale=self.stale_slots)  # fmt: skip

    def _chosen(self, judged: HomeOffer | None) -> tuple[int, ...]:
        """The order ``judged`` chose, else the linear map (from the linear map)."""
        return tuple(range(self.num_experts)) if judged is None else judged.perm_E

    def _own_rehome(self, counts_RE: torch.Tensor) -> None:
        """The runtime's own re-home at the first step after its first window (counts of
        this step ``[R, E]``, by expert: the map is still linear), judged against the
        slots serving; where it moves, the slots empty and the decisions take the new
        labels (:meth:`_relabel`)."""
        if len(self._seen) < self.window:
            self._seen.append(counts_RE.sum(0))
            return
        assert self.slots is not None
        empty_RB = empty_slots(self.num_ranks, self.slots)
        serving_RB = empty_RB if self._previous is None else self._previous.slot_expert.cpu()
        judged = self._judged(torch.stack(self._seen), serving_RB)
        self._seen = []
        if judged is not None:
            self._relabel(judged)

    def reset(self) -> None:
        if self._own:  # back to the linear map, its own re-home to come
            self.home_order, self.rehome, self._seen = None, True, []
        else:
            self.rehome = False
        if self._undo:  # the training re-homes of a run before
            self.home_order = self._undo.pop()
        self._blocking_s = 0.0
        self._fresh_slots()

    def _fresh_slots(self) -> None:
        """Empty slots, a fresh residency and no refill (a new policy's)."""
        self._previous = None
        self.decisions: Decisions | None = None
        if self.staging:  # stale slots (training): no refill, only the way of the steps
            assert self.slots is not None
            res = Residency(self.num_ranks, self.num_experts, self.slots, self.cost,
                            window=self.window, staging=self.staging)  # fmt: skip
            self.decisions = Decisions(res)  # inline, the same lag
        self._order: Refill | None = None  # the refill being copied
        # refill_ER of each step still to copy (None: another layer's turn)
        self._shares: list[torch.Tensor | None] = []

    @property
    def residency(self) -> Residency | None:
        """The placement's residency (``None`` without background refills)."""
        return None if self.decisions is None else self.decisions.residency

    def steps_before(self) -> list[tuple[int, int]]:
        """The window's steps before the trace (``UsesPrehistory``)."""
        reads = self.residency is not None or self.profiled or self.rehome
        return [(-self.window, 0)] if reads else []

    def prime(self, before: Prehistory) -> None:
        """Place the slots from the window before the trace (served from step 0)."""
        if (self.profiled or self.rehome) and self.home_order is None:  # its own window:
            mine_N = before.steps_N >= -self.window  # others' steps are drawn too
            if bool(mine_N.any()):
                self.home_order = self._chosen(self._judged(before.totals_NE[mine_N], None))
        res = self.residency
        if res is None or self._previous is not None:
            return
        slot_RB = res.prime(self._labelled(before.totals_NE), stale=self.stale_slots)
        zero_RE = torch.zeros(self.num_ranks, self.num_experts, dtype=torch.int64)
        self._previous = serving_plan(zero_RE, slot_RB)

    def _labelled(self, counts_XE: torch.Tensor) -> torch.Tensor:
        """``counts_XE`` (``[..., E]``, by expert) by label (``home_order``)."""
        if self.home_order is None:
            if self.profiled:
                raise ValueError(f"{self.name}: home_order={PROFILE!r} needs prime() (the "
                                 "steps before the trace) before the first step; a recorded "
                                 "trace has none: give profile= (e.g. "
                                 "moonplan.simulate.acceptance.profile_loads)")  # fmt: skip
            return counts_XE
        return counts_XE[..., torch.tensor(self.home_order, device=counts_XE.device)]

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)  # by expert
        blocking_s, self._blocking_s = self._blocking_s, 0.0  # a re-home before this step
        if self.rehome:
            self._own_rehome(counts_RE)
        counts_RE = self._labelled(counts_RE)
        swapped = self._commit(counts_RE)
        way = "call" if self.decisions is None else self.decisions.way(self.stale_slots)
        if way == EXACT:  # the exact kernel with previous=: moonplan-resident's step
            p = self.plan(counts_RE, self._previous, policy=EXACT)
            charge_s = exact_charge_s(self.cost)
        elif way != "call":
            p, charge_s = self._uncalled(counts_RE, way), 0.0  # as EPLB's
        else:
            p = self.plan(counts_RE, self._previous)
            charge_s = self._charge_s(p)
        planned = charge_s / self.cost.plan_s if self.cost.plan_s > 0 else 0.0  # in calls
        self._previous = p
        refill_ER = self._shares.pop(0) if self._shares else None
        self._place(counts_RE, p)
        return plan_step(self.name, counts_RE, p, planned=planned, choice=p.policy,
                         refill_ER=refill_ER, local_copies=swapped,
                         blocking_s=blocking_s)  # fmt: skip

    def _uncalled(self, counts_RE: torch.Tensor, how: str) -> Plan:
        """The serving slots' lookup plan ``how``, without a planner call
        (``Decisions.serve``: calls do not pay over the window), as the runtime serves it
        (over empty slots where they go stale: static EP)."""
        if self._previous is None or self.stale_slots:
            assert self.slots is not None
            slot_RB = empty_slots(self.num_ranks, self.slots)
        else:
            slot_RB = self._previous.slot_expert.cpu()
        shares = None if self.decisions is None else self.decisions.shares(self.stale_slots)
        return lookup_way(counts_RE, slot_RB, how, shares)

    def _charge_s(self, p: Plan) -> float:
        """Seconds of the step's ``auto`` call: the exit's test or the full call, and the
        rounds of the ``resident`` build the call ran."""
        assert p.choice is not None  # an auto plan
        rounds = int(p.choice.rounds)
        if p.choice.early_exit():  # the test, and the resident candidate's build if made
            return exit_rounds_s(self.cost, rounds)
        return call_rounds_s(self.cost, rounds)

    def _place(self, counts_RE: torch.Tensor, p: Plan) -> None:
        """Hand the step to the placement's decisions (the runtime's rule:
        :class:`~moonplan.plan.residency.refill.Decisions`, on a host thread: no device
        time); start copying the refill it orders."""
        if self.decisions is None:
            return
        busy = self._order is not None
        order = self.decisions.step(counts_RE, p, busy, self.stale_slots, self.move_bytes)
        home = self.decisions.take_home()
        if home is not None:  # rent or buy says a re-home pays: after the step
            self._take_home(home)
            return
        if order is not None:
            now = plan_time(self.cost, p, planned=0)
            link_s = refill_link_s(self.cost, order.fetch_ER, p.home.cpu())
            n = 1 if now.experts_s <= 0 else max(1, math.ceil(link_s / now.experts_s))
            turn: list[torch.Tensor | None] = [None] * (n * (self.layers - 1))  # others copy
            self._order, self._shares = order, turn + list(split_pairs(order.fetch_ER, n))

    def _take_home(self, offer: HomeOffer) -> None:
        """Re-home to ``offer``'s order (labels) between this step and the next, as the
        runtime does at the start of the next step: that step pays the rows' link time
        (``refill.rehome_link_s`` at :data:`TRAINING_MOVE_BYTES`); then
        :meth:`_relabel`."""
        if not self._undo:
            self._undo.append(self.home_order)
        perm_E = list(offer.perm_E)
        self._blocking_s = rehome_link_s(self.cost, perm_E, self.num_ranks, self.move_bytes)
        self._relabel(offer)

    def _relabel(self, judged: HomeOffer) -> None:
        """Take the labels of a re-home to ``judged``'s order (new label ``j`` is old label
        ``perm_E[j]``), as the runtime's ``BetweenSteps.rehome``: the slots empty, a refill
        still copying is dropped, and the decisions take the new labels
        (``Decisions.relabel``: the window's loads stay, relabelled; the steps serve the
        way the judgement that chose the order found for them)."""
        current = self.home_order or tuple(range(self.num_experts))
        self.home_order = tuple(current[j] for j in judged.perm_E)
        self._previous, self._order, self._shares = None, None, []
        if self.decisions is not None:
            self.decisions.relabel(torch.tensor(judged.perm_E, dtype=torch.int64), judged)

    def _commit(self, counts_RE: torch.Tensor) -> int:
        """Swap an arrived refill into the slots (the most swapped on one rank)."""
        if self._order is None or self._shares or self._previous is None:
            return 0
        slot_RB, changed_RB = swapped_slots(self._previous.slot_expert.cpu(), self._order)
        self._previous, self._order = serving_plan(counts_RE, slot_RB), None
        if self.decisions is not None:
            self.decisions.arrived(slot_RB)  # the refilled table serves its own way
        return int(changed_RB.sum(1).max())


TRAINING_MOVE_BYTES = 6.0
"""Bytes a training re-home moves per byte of an expert's weights in the simulator: bf16
weights and gradients, fp32 Adam moments (``(2 + 2 + 4 + 4) / 2``); the runtime counts
the tensors it moves (``ShardedExperts.optimizer_stepped``)."""

PROFILE = "profile"
"""``home_order`` of :class:`MoonplanAutoPolicy` taken from the window before the trace."""


class MoonplanAutoOrdered(MoonplanAutoPolicy):
    """:class:`MoonplanAutoPolicy` over a home order from a profile (``home_order``;
    default ``"profile"``: the window before the trace), a user's one re-home: the
    layer's own re-homes are off (``rehome=False`` unless given), so the order given is
    the one measured."""

    name = "moonplan-auto-ordered"

    def __init__(self, num_ranks: int, num_experts: int, **options: Any) -> None:
        options.setdefault("home_order", PROFILE)
        options.setdefault("rehome", False)
        super().__init__(num_ranks, num_experts, **options)


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
    if name == MoonplanAutoOrdered.name:
        return MoonplanAutoOrdered(num_ranks, num_experts, **options)
    return MoonplanAutoPolicy(num_ranks, num_experts, **options)


# Both exact variants take `slots`; auto also needs `cost` (the StepCost it minimises).
register(PolicyInfo("moonplan", _moonplan, style=("-", "o"), plan_us=exact_us,
                    options=("slots", "stale_slots"), order=60))  # fmt: skip
register(PolicyInfo("moonplan-resident", _moonplan, label="resident", style=("-", "D"),
                    plan_us=exact_us, options=("slots", "stale_slots"), order=70))  # fmt: skip
AUTO_OPTIONS = ("cost", "slots", "placement_window", "staging", "layers", "stale_slots",
                "rehome")  # fmt: skip


def _auto_info(name: str, **fields: Any) -> PolicyInfo:
    """An auto registration: auto's planning and decision times, and ``fields``."""
    return PolicyInfo(name, _auto, plan_us=auto_us, exit_us=exit_us, round_us=ROUND_US,
                      decide_us=decision_build_us, exact_us=exact_us,
                      score_us=decision_score_us, **fields)  # fmt: skip


register(_auto_info("moonplan-auto", label="auto", options=AUTO_OPTIONS, order=80))
# auto over a home order from a profile (the runtime's home_order=): not in the default set
register(_auto_info(MoonplanAutoOrdered.name, label="auto+order", style=("--", "^"),
                    options=(*AUTO_OPTIONS, "home_order", "profile"), order=85,
                    listed=False))  # fmt: skip
