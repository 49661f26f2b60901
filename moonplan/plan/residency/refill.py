"""When a refill pays, and the :class:`Residency` the runtime and the simulator both run.

Legend:
    R ranks    E experts    B slots per rank    S staging rows per rank
    slot_RB    int64 ``[R, B]`` the expert in each slot (``-1``: empty)
    fetch_ER   bool ``[E, R]`` the pairs a refill copies

Each step :meth:`Residency.observe` adds the step's loads to the window; a decision
(:meth:`Residency.decide`, as often as its work fits beside the steps) asks
:func:`~moonplan.plan.residency.target.target_of` which table the slots should hold,
keeps at most ``S`` changes per rank (a rank copies into ``S`` staging rows beside the
steps and swaps them in at once; :func:`limit_changes`), and decides by rent or buy:

* ``rent``: what the steps since the last decision lost by serving the current slots
  instead of the target's, both planned as ``auto`` would
  (:func:`~moonplan.plan.residency.target.served_s`; ``max(0, now - target)`` on the last
  step, predicted, once per step);
* ``price``: the refill's copies, their link time alone (:func:`refill_link_s`);
* the rent accrues in ``credit``; once ``credit >= price`` the refill is ordered and the
  credit returns to 0.

So a refill is made only once going without it has cost as much as its copies: on a
steady popularity the target stays the serving table and nothing is copied; after the hot
set moves, the window follows within ``W`` steps and the rent pays the copies soon after.
The rule's bound is the ski-rental one (``moonplan.plan.choice.rent``): at most twice the
better of never copying and copying at once, with no horizon or constant.

The same decision says how each table is served (``target.table_ways``): by a planner
call every step (``auto``, each charged the exit's test or the full calls it makes), or,
where no way served by calls is predicted faster over the window, by one of the table's
lookup plans with no call (``serving.lookup_plan``: whole moves, or each expert split
evenly over its holders, as a placement like EPLB's serves; or ``serving.weighted_plan``,
in the shares the decision fit to the window, which the verdict carries; static EP over an
empty table).
The serving slots serve their own way (``Target.kept``) until a refill arrives; the refill
then serves its table's way (``Refill.serve``). Where exact balance every step from the
serving slots (``exact_way``: the exact kernel with ``previous=``, no table kept) beats
every table over the window, the steps serve that and nothing is refilled. The call's
price is what the kernel measured (``StepCost.exit_s``, ``plan_s``, ``exact_s``), so where
no balance saves that much (decode sizes), ``auto`` serves a fixed map and pays no
planning, as its peers do. A refill's rent is what the serving table, served its way,
loses against the refill's table served its own.

Where the steps' slots go stale (training: the weights change every step), a decision
orders no refill. Such a step is a training step: its backward replays the plan, so each
is scored with it (``moonplan.stepcost.training``), and so is the step its answer's lag
is counted in. It judges the way of such steps and, given a snapshot's ``move_bytes``,
a re-home by the same rule (:meth:`Residency._home`): the rent is what each step loses
under the current home map against the window's ``popular_order``, both with no slot
kept (``home_choice.stale_offer``); the price is the moved experts' rows, their link time
alone, times ``move_bytes`` (gradients and optimizer state move too:
:func:`rehome_link_s`). The verdict carries the order (``Verdict.home``); the
layer takes it at the start of its next step, with its optimizer's state
(``moonplan.core.optimizer_rehome``).
A re-home relabels the window and keeps its loads (:meth:`Decisions.relabel`); the
steps after it are served the way the offer judged for them under the new order.

Every input is all-gathered (the same on every rank), so every rank orders the same
refill at the same step.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from moonplan.plan.home import home_map
from moonplan.plan.plan_time import plan_time
from moonplan.plan.plan_type import Plan
from moonplan.plan.residency.exact_way import EXACT, exact_steps_s
from moonplan.plan.residency.home_choice import HomeOffer, stale_offer
from moonplan.plan.residency.serving import LOOKUPS, WEIGHTED, empty_slots
from moonplan.plan.residency.shares import Shares
from moonplan.plan.residency.stale_steps import StaleSteps, stale_steps
from moonplan.plan.residency.target import (
    candidate_tables,
    served_s,
    step_time_over,
    table_ways,
    target_of,
    window_rows,
)
from moonplan.plan.residency.weighted_way import held_out_shares, verdict_shares
from moonplan.plan.residency.window import WINDOW, LoadWindow
from moonplan.plan.residency.window_torch import (
    built_s,
    lookups_torch,
    static_torch,
    tables_of,
    unbuilt_tables,
)
from moonplan.plan.residency.work import Builds, work_s
from moonplan.stepcost import StepCost
from moonplan.stepcost.training import training_time

STAGING = 1
"""Default ``S``: staging rows per rank (one expert's weights: a refill changes at most one
slot per rank)."""


@dataclass(frozen=True)
class Verdict:
    """A decision (:meth:`Residency.judge`): the refill to order (``None``: none) and how
    the serving slots are served until it arrives (``Target.kept``: ``"call"``, a lookup
    or ``"exact"``; the refill says how its own table serves, ``Refill.serve``);
    ``stale``: judged for steps whose slots go stale (no refill then); ``shares``: the
    weighted lookup's ``shares.Shares`` (on the host) where ``serve`` is that way
    (``serving.WEIGHTED``), else ``None``; ``home``: a re-home that rent or buy says pays
    (``home_choice.HomeOffer``: its order in labels and its steps' way; steps whose slots
    go stale only, :meth:`Residency.judge`), else ``None``."""

    order: Refill | None
    serve: str
    stale: bool = False
    shares: Shares | None = None
    home: HomeOffer | None = None


@dataclass(frozen=True)
class Refill:
    """A refill order, the same on every rank.

    Attributes:
        slot_RB: int64 ``[R, B]``, the slots once every copy has arrived.
        changed_RB: bool ``[R, B]``, the slots the refill writes.
        fetch_ER: bool ``[E, R]``, the pairs copied (each from its expert's home).
        serve: how ``slot_RB`` serves once it has arrived (``"call"`` or a lookup: the
            way of least predicted time over the window, ``target.table_ways``).
        shares: the weighted lookup's ``shares.Shares`` where ``serve`` is that way
            (``None`` otherwise).
    """

    slot_RB: torch.Tensor
    changed_RB: torch.Tensor
    fetch_ER: torch.Tensor
    serve: str = "call"
    shares: Shares | None = None


def swap_in(
    last_RB: torch.Tensor, target_RB: torch.Tensor, changed_RB: torch.Tensor
) -> torch.Tensor:
    """int64 ``[R, B]`` on the host: the slots once a refill's copies are swapped in. The
    last plan's slots (``last_RB``: the steps since the order may have filled others), each
    ``changed_RB`` slot holding ``target_RB``'s expert; another slot of the same rank that
    holds an expert the refill brings is emptied (a rank holds an expert once). The
    runtime's commit and the simulator's both call it."""
    slot_RB = last_RB.detach().to("cpu", torch.int64).clone()
    changed_RB = changed_RB.cpu()
    slot_RB[changed_RB] = target_RB.cpu()[changed_RB]
    for r, j in changed_RB.nonzero().tolist():
        twin = (slot_RB[r] == slot_RB[r, j]) & (torch.arange(slot_RB.shape[1]) != j)
        slot_RB[r, twin] = -1
    return slot_RB


def swapped_slots(last_RB: torch.Tensor, order: Refill) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot_RB, changed_RB)`` once ``order``'s copies are swapped in (:func:`swap_in`)."""
    return swap_in(last_RB, order.slot_RB, order.changed_RB), order.changed_RB


def changed_pairs(
    target_RB: torch.Tensor, current_RB: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """bool ``[E, R]``: the experts ``target_RB`` puts in a slot where ``current_RB`` holds
    another."""
    new_RB = (target_RB != current_RB) & (target_RB >= 0)
    r_C, j_C = new_RB.nonzero(as_tuple=True)
    fetch_ER = torch.zeros(num_experts, target_RB.shape[0], dtype=torch.bool)
    fetch_ER[target_RB[r_C, j_C], r_C] = True
    return fetch_ER


def limit_changes(
    target_RB: torch.Tensor, current_RB: torch.Tensor, staging: int, totals_E: torch.Tensor
) -> torch.Tensor:
    """The table a refill toward ``target_RB`` makes: ``current_RB`` with at most
    ``staging`` slots per rank changed to the target's expert, those whose new expert has
    the most records in the window (ties: lower slot). A slot the target leaves empty
    keeps its expert (a refill only copies in; an unused resident costs nothing to keep)."""
    out = current_RB.clone()
    for r in range(target_RB.shape[0]):
        changed = [j for j in range(target_RB.shape[1])
                   if 0 <= target_RB[r, j] != current_RB[r, j]]  # fmt: skip
        worth = sorted((-int(totals_E[int(target_RB[r, j])]), j) for j in changed)
        for _, j in worth[:staging]:
            out[r, j] = target_RB[r, j]
    return out


def refill_link_s(cost: StepCost, fetch_ER: torch.Tensor, src_E: torch.Tensor) -> float:
    """Seconds the copies of ``fetch_ER`` (bool ``[E, R]``, each from ``src_E[e]``) take
    alone on the links: ``cost``'s fetch of those pairs in a step with no rows."""
    if not bool(fetch_ER.any()):
        return 0.0
    E, R = fetch_ER.shape
    none_ER = torch.zeros(E, R, dtype=torch.int64)
    none_RE = torch.zeros(R, E, dtype=torch.int64)
    return float(cost.step_time(none_ER, none_RE, fetch_ER, src_E, planned=0).prefetch_s)


def rehome_link_s(cost: StepCost, perm_E: list[int], num_ranks: int, move_bytes: float) -> float:
    """Seconds a re-home to ``perm_E`` (labels: new label ``j`` is old label
    ``perm_E[j]``) takes alone on the links: each expert that changes rank copied once
    from its old home rank to its new one (:func:`refill_link_s`), times ``move_bytes``:
    the bytes that move per byte of the expert's weights (1 serving; its gradient and
    optimizer state as well in training)."""
    E = len(perm_E)
    old_E = home_map(E, num_ranks)  # rank of each label now
    new_E = torch.empty(E, dtype=torch.int64)
    new_E[torch.tensor(perm_E, dtype=torch.int64)] = old_E  # old label -> its new rank
    moved_E = new_E != old_E
    fetch_ER = torch.zeros(E, num_ranks, dtype=torch.bool)
    fetch_ER[moved_E.nonzero().flatten(), new_E[moved_E]] = True
    return refill_link_s(cost, fetch_ER, old_E) * move_bytes


@dataclass(frozen=True)
class Snapshot:
    """A decision's inputs (:meth:`Residency.snapshot`).

    Attributes:
        counts_RE: int64 ``[R, E]``, the last step's counts.
        serving_RB: int64 ``[R, B]``, the slots that step served.
        totals_E: int64 ``[E]``, the window's loads; filled: the steps it holds.
        steps: the steps since the last decision.
        loads_SE: int64 ``[filled, E]``, each step's loads the window holds, oldest first.
        stale: that step's slots went stale (its weights changed, as at every training
            step): the decision judges a way for steps whose slots do not stay.
        move_bytes: bytes a re-home moves per byte of an expert's weights (its gradient
            and optimizer state too, in training); ``0``: no re-home is offered.
    """

    counts_RE: torch.Tensor
    serving_RB: torch.Tensor
    totals_E: torch.Tensor
    filled: int
    steps: int
    loads_SE: torch.Tensor
    stale: bool = False
    move_bytes: float = 0.0


class Residency:
    """One layer's window, target and rent-or-buy credit (module docstring).

    Args:
        num_ranks, num_experts: ``R``, ``E``; num_slots: ``B``, the serving slots.
        cost: the cost model the target and the rule predict with.
        window: ``W`` steps of loads; staging: ``S`` changes per refill and rank.
        device: where the window lives (the counts'): observing a step reads nothing on
            the host; a decision reads the window once.
    """

    def __init__(
        self,
        num_ranks: int,
        num_experts: int,
        num_slots: int,
        cost: StepCost,
        *,
        window: int = WINDOW,
        staging: int = STAGING,
        device: torch.device | None = None,
    ):
        if isinstance(staging, bool) or not isinstance(staging, int) or staging < 1:
            raise ValueError(f"staging must be an integer >= 1, got {staging!r}")
        self.R, self.E, self.B = num_ranks, num_experts, num_slots
        self.cost, self.staging = cost, staging
        self.window = LoadWindow(num_experts, window, device)
        self.credit = 0.0
        self.home_credit = 0.0  # a re-home's rent accrued (steps whose slots go stale)
        self.home_E = home_map(num_experts, num_ranks)
        self.primed = Verdict(None, "call")  # the window's before the trace (:meth:`prime`)

    def prime(self, totals_NE: torch.Tensor, stale: bool = False) -> torch.Tensor:
        """Fill the window with the totals of steps before the first (int64 ``[N, E]``)
        and return the table serving at step 0: the target from empty slots, placed
        before the trace (no staging limit); :attr:`primed` says how those steps are best
        served: the way a decision judges for that table kept (``Target.kept``: its
        lookups, planner calls, or the exact kernel from it). ``stale``: the steps'
        slots go stale (training): no table, and the way for such steps
        (``stale_steps.StaleSteps.best``)."""
        self.window.prime(totals_NE)
        empty_RB = empty_slots(self.R, self.B)
        if self.window.filled == 0 or self.B == 0:
            return empty_RB
        totals_E, loads_SE = self.window.totals_E().cpu(), self.window.loads()
        rows_SRE = window_rows(totals_E, self.window.filled, self.R, loads_SE)
        if stale:
            self.primed = self._stale(rows_SRE, loads_SE, None)
            return empty_RB
        got = target_of(totals_E, self.window.filled, empty_RB, self.cost, loads_SE)
        serve = got.serve
        if serve != EXACT:  # the placed table kept, as a decision judges it: exact from it too
            exact_s = sum(exact_steps_s(self.cost, rows_SRE, got.slot_RB))
            serve = EXACT if exact_s < got.seconds else serve
        self.primed = Verdict(None, serve, shares=self._shares(rows_SRE, got.slot_RB, serve))
        return got.slot_RB

    def relabel(self, columns_E: torch.Tensor) -> None:
        """The layer re-homed: new label ``j`` is old label ``columns_E[j]`` (int64
        ``[E]``, a permutation). The window's loads stay (they are the same experts',
        relabelled); the rent accrued returns to 0 (it was for tables and orders in the
        old labels)."""
        self.window.relabel(columns_E)
        self.credit = self.home_credit = 0.0

    def observe(self, counts_RE: torch.Tensor) -> None:
        """Add a step's counts (int64 ``[R, E]``, on the window's device) to the window."""
        self.window.observe(counts_RE.to(self.window.loads_WE.device))

    def decide(
        self, counts_RE: torch.Tensor, serving_RB: torch.Tensor, steps: int = 1
    ) -> Refill | None:
        """The refill to order now, or ``None`` (module docstring): ``counts_RE`` the last
        step's counts, ``serving_RB`` the slots it served (``[R, B]``), ``steps`` the steps
        since the last decision (each accrues this step's rent)."""
        return self.decide_on(self.snapshot(counts_RE, serving_RB, steps))

    def snapshot(
        self,
        counts_RE: torch.Tensor,
        serving_RB: torch.Tensor,
        steps: int = 1,
        stale: bool = False,
        move_bytes: float = 0.0,
    ) -> Snapshot:
        """What a decision reads, copied now (on the device: no host read), so that it can
        run beside the next steps while the window moves on (``stale``, ``move_bytes``:
        :class:`Snapshot`)."""
        return Snapshot(counts_RE.clone(), serving_RB.clone(), self.window.totals_E().clone(),
                        self.window.filled, steps, self.window.loads().clone(), stale,
                        move_bytes)  # fmt: skip

    def decide_on(self, snap: Snapshot, builds: Builds | None = None) -> Refill | None:
        """:meth:`decide` on a :class:`Snapshot` (reads it on the host; one at a time);
        ``builds`` counts the builds of the ``resident`` candidate it makes."""
        return self.judge(snap, builds).order

    def judge(self, snap: Snapshot, builds: Builds | None = None) -> Verdict:
        """The refill :meth:`decide_on` orders and whether calls pay (module docstring)."""
        if self.B == 0:
            return Verdict(None, "call")
        totals_E = snap.totals_E.cpu()
        rows_SRE = window_rows(totals_E, snap.filled, self.R, snap.loads_SE)
        if snap.stale:  # no slot stays: no refill, the way for such steps, a re-home
            return self._stale(rows_SRE, snap.loads_SE, builds, snap)
        serving_RB = snap.serving_RB.cpu()
        got = target_of(totals_E, snap.filled, serving_RB, self.cost, snap.loads_SE, builds)
        target_RB = limit_changes(got.slot_RB, serving_RB, self.staging, totals_E)
        kept = self._shares(rows_SRE, serving_RB, got.kept)
        if torch.equal(target_RB, serving_RB):
            return Verdict(None, got.kept, shares=kept)
        arriving = got.serve
        if not torch.equal(target_RB, got.slot_RB):  # the staging limit stops short of it
            ways_1 = table_ways(self.cost, rows_SRE, target_RB[None], snap.loads_SE, builds)
            arriving = ways_1[0][1]
        order = self._rent(snap, rows_SRE, (serving_RB, target_RB), (got.kept, arriving), builds)
        return Verdict(order, got.kept, shares=kept)

    def _stale(
        self,
        rows_SRE: torch.Tensor,
        loads_SE: torch.Tensor,
        builds: Builds | None,
        snap: Snapshot | None = None,
    ) -> Verdict:
        """The verdict for steps whose slots go stale (training steps, each with its
        backward): no refill, and the way of least predicted time from empty slots over
        the window (``stale_steps``; never the weighted lookup, which is static EP there);
        from a ``snap`` with ``move_bytes``, a re-home once rent or buy says it pays
        (:meth:`_home`, weighed against the same scores)."""
        now = stale_steps(self.cost, rows_SRE, self.B, loads_SE, builds, training=True)
        home = None if snap is None or snap.move_bytes <= 0 else self._home(snap, now, builds)
        return Verdict(None, now.best()[1], True, home=home)

    def _home(self, snap: Snapshot, now: StaleSteps, builds: Builds | None) -> HomeOffer | None:
        """Rent or buy for a re-home, as for a refill: each step since the last decision
        accrues the seconds the window's order would save it (``home_choice.stale_offer``:
        fit on the window's older half, scored on its newer half, no slot kept; the labels'
        own seconds read from ``now``, the window's scores). Once the credit reaches the
        order's price, its rows' link time (:func:`rehome_link_s`, ``snap.move_bytes`` per
        byte of weights), the order is offered and the credit returns to 0."""
        offer = stale_offer(self.cost, snap.loads_SE, self.R, self.B, builds, now)
        if offer is None:
            return None
        self.home_credit += snap.steps * offer.saving_s
        price_s = rehome_link_s(self.cost, list(offer.perm_E), self.R, snap.move_bytes)
        if self.home_credit < price_s:
            return None
        self.home_credit = 0.0
        return offer

    def _shares(self, rows_SRE: torch.Tensor, slot_RB: torch.Tensor, way: str) -> Shares | None:
        """The weighted lookup's shares of ``slot_RB`` fit to the window's steps
        ``rows_SRE`` (``weighted_way.verdict_shares``), where ``way`` is that lookup (else
        ``None``)."""
        return verdict_shares(self.cost, rows_SRE, slot_RB) if way == WEIGHTED else None

    def _rent(
        self,
        snap: Snapshot,
        rows_SRE: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        ways: tuple[str, str],
        builds: Builds | None,
    ) -> Refill | None:
        """The refill from the serving table to the target's (``tables``, ``[R, B]``
        each, on the host) once rent or buy says it pays (module docstring), the last
        step served by each table its own way (``ways``: by calls, or by a lookup, the
        weighted one with shares fit on the window's other steps, ``rows_SRE``)."""
        serving_RB, target_RB = tables
        c_RE = snap.counts_RE.cpu().numpy().astype(np.int64)
        now = self._step_s(c_RE, serving_RB, ways[0], builds, rows_SRE)
        after = self._step_s(c_RE, target_RB, ways[1], builds, rows_SRE)
        fetch_ER = changed_pairs(target_RB, serving_RB, self.E)
        self.credit += snap.steps * max(0.0, now - after)
        if self.credit < refill_link_s(self.cost, fetch_ER, self.home_E):
            return None
        self.credit = 0.0
        shares = self._shares(rows_SRE, target_RB, ways[1])
        return Refill(target_RB, target_RB != serving_RB, fetch_ER, ways[1], shares)

    def _step_s(
        self,
        c_RE: np.ndarray,
        slot_RB: torch.Tensor,
        how: str,
        builds: Builds | None,
        rows_SRE: torch.Tensor | None = None,
    ) -> float:
        """Predicted seconds of the step ``c_RE`` (int64 ``[R, E]``) over ``slot_RB``,
        served ``how``: by calls (``target.served_s``, planning included), a lookup (the
        weighted one with shares fit on the steps of the window ``rows_SRE`` before its
        last, the step scored: ``weighted_way.held_out_shares``), or the exact way (its
        plan from ``slot_RB``, its copies and call included)."""
        if how == EXACT:
            return exact_steps_s(self.cost, torch.from_numpy(c_RE)[None], slot_RB, builds)[0]
        if how == "call":
            empty_RB = np.full((self.R, self.B), -1, dtype=np.int64)
            static = step_time_over(self.cost, c_RE, empty_RB, builds)
            return served_s(self.cost, c_RE, slot_RB.numpy(), static, builds)
        rows_1RE = torch.from_numpy(c_RE)[None]
        if how == WEIGHTED:
            if rows_SRE is None:
                raise ValueError("the weighted lookup is scored with the window's steps")
            weight_11ER = held_out_shares(self.cost, rows_SRE, slot_RB).weight_ER[None, None]
            got_L11 = lookups_torch(self.cost, rows_1RE, slot_RB[None], builds, weight_11ER)
            return float(got_L11[-1, 0, 0])
        got_L11 = lookups_torch(self.cost, rows_1RE, slot_RB[None], builds)
        return float(got_L11[LOOKUPS.index(how), 0, 0])


@dataclass(frozen=True)
class Answer:
    """A decision's answer (:meth:`Decisions.step`).

    Attributes:
        verdict: the refill to order and the way of the steps (:class:`Verdict`).
        steps: the fewest steps whose predicted time covers its counted work
            (:class:`Builds`, at the host's rates: ``work.work_s``; at least 1).
    """

    verdict: Verdict
    steps: int


class Decisions:
    """When a residency decides, and when its answer is used: one rule for the runtime's
    placer and the simulator's ``moonplan-auto``.

    A decision starts once ``due`` steps have passed since the last one (and no refill is
    in flight), from a :class:`Snapshot` of that step, and runs on the host beside the next
    steps (inline, or a worker's ``submit``); its window scores run on the window's device
    (with a worker and CUDA counts, on a side stream, after the snapshot's copies). It
    counts its own work as it runs
    (:class:`Builds`: the builds of the ``resident`` candidate it makes, only where the
    exit's gate lets one through, and the (step, table) pairs it scores), at the cost
    model's host rates (``moonplan.plan.residency.work``), and the fewest steps whose
    predicted time covers it. Its answer is read ``due`` steps after it started
    (waiting for it if it is not done) and used once those steps have passed too, so no
    answer is used before its counted work could have run. ``due`` then becomes that count
    of steps, the next decision's guess. Every quantity read is agreed (the counts, the
    plans, the cost model, the work a decision counts), so every rank starts and uses
    each decision at the same step.

    Args:
        residency: the layer's :class:`Residency` (its ``cost`` gives the rate).
        submit: runs a job beside the steps and returns its future (``None``: inline).

    :attr:`serve` says how the steps are served: by a planner call (``"call"``,
    ``policy="auto"``), by a lookup plan of the slots without one (``serving.LOOKUPS``, or
    ``serving.WEIGHTED`` with the verdict's shares, :meth:`shares`),
    or by the exact kernel every step (``"exact"``, ``exact_way``):
    the way the last used answer judged best for the slots serving (before the first,
    the residency's from the window before the trace, else ``"call"``), until a refill it
    ordered arrives (:meth:`arrived`), which serves its own table's way. A way is judged
    for one table: the target's way over the old slots once made a step 2x slower
    (a whole-move lookup over slots placed for splitting). Likewise after a re-home
    (:meth:`relabel`): the way its judgement found for its steps, else planner calls,
    until the next decision; the window's loads stay, relabelled.
    """

    def __init__(
        self,
        residency: Residency,
        submit: Callable[[Callable[[], Answer]], Future[Answer]] | None = None,
    ):
        self.residency, self.submit = residency, submit
        self.since, self.due = 0, 1
        self._side: torch.cuda.Stream | None = None  # a worker's decisions on CUDA counts
        self._pending: tuple[Future[Answer] | Answer, int] | None = None  # (answer, lag)
        self._verdict: Verdict | None = None  # the last used answer's (None: none yet)
        self.home: HomeOffer | None = None  # a re-home offered, until taken
        self._ordered: Refill | None = None  # the last refill handed out, until it arrives

    @property
    def serve(self) -> str:
        """How steps whose slots stay are served (class docstring): :meth:`way`."""
        return self.way(stale=False)

    def way(self, stale: bool) -> str:
        """How a step is served whose slots went stale (``stale``: its weights changed, as
        at every training step) or stay: the last used answer's way where it was judged
        for such steps, else ``"call"`` (a way judged for slots that stay does not hold
        where they go, nor the other way round)."""
        verdict = self._judged_for(stale)
        return "call" if verdict is None else verdict.serve

    def shares(self, stale: bool) -> Shares | None:
        """The weighted lookup's ``shares.Shares`` (on the host) where :meth:`way` is that
        lookup (``serving.WEIGHTED``), else ``None``."""
        verdict = self._judged_for(stale)
        return None if verdict is None else verdict.shares

    def _judged_for(self, stale: bool) -> Verdict | None:
        """The verdict in force (the last used answer's, else the residency's from the
        window before the trace) where it was judged for such steps, else ``None``."""
        verdict = self.residency.primed if self._verdict is None else self._verdict
        return verdict if verdict.stale == stale else None

    def step(
        self,
        counts_RE: torch.Tensor,
        plan: Plan,
        busy: bool,
        stale: bool = False,
        move_bytes: float = 0.0,
    ) -> Refill | None:
        """Observe a finished step (its counts and plan, whose slots serve; ``stale``: they
        went stale at that step; ``move_bytes``: :class:`Snapshot`); the refill to order
        now, or ``None``. A re-home a used answer offers waits in :attr:`home`."""
        self.residency.observe(counts_RE)
        self.since += 1
        if self._pending is not None:
            return self._use(busy)
        if busy or self.since < self.due:
            return None
        snap = self.residency.snapshot(counts_RE, plan.slot_expert, self.since, stale, move_bytes)
        job: Callable[[], Answer] = functools.partial(self._decide, snap, plan)
        if self.submit is not None and snap.loads_SE.is_cuda:
            job = self._on_side_stream(job, snap.loads_SE.device)
        answer = job() if self.submit is None else self.submit(job)
        self._pending, self.since = (answer, self.due), 0
        return None

    def _on_side_stream(
        self, job: Callable[[], Answer], device: torch.device
    ) -> Callable[[], Answer]:
        """``job`` on a side stream of ``device`` (the steps' stream keeps running), after
        the work queued so far on the current stream (the snapshot's copies)."""
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        side, ready = self._side, torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))

        def run() -> Answer:
            side.wait_event(ready)
            with torch.cuda.stream(side):
                return job()

        return run

    def settle(self) -> None:
        """Wait for a decision still running on the worker (its answer and errors are
        dropped: call it before the worker's owner goes)."""
        if self._pending is not None and isinstance(self._pending[0], Future):
            self._pending[0].exception()  # waits; the error, if any, is not raised

    def _use(self, busy: bool) -> Refill | None:
        """The pending decision's order once its lag and its counted work have passed."""
        assert self._pending is not None
        pending, lag = self._pending
        if self.since < lag:
            return None
        answer = pending.result() if isinstance(pending, Future) else pending
        if self.since < answer.steps:  # its work covers more steps than the lag guessed
            self._pending = (answer, answer.steps)
            return None
        self._pending, self.due, self._verdict = None, answer.steps, answer.verdict
        if answer.verdict.home is not None:  # the layer takes it at its next chance
            self.home = answer.verdict.home
        order = answer.verdict.order
        if busy or order is None:
            return None
        self._ordered = order
        return order

    def take_home(self) -> HomeOffer | None:
        """The re-home a used answer offered (:attr:`home`, labels), once; ``None`` if
        none waits."""
        home, self.home = self.home, None
        return home

    def relabel(self, columns_E: torch.Tensor, judged: HomeOffer | None = None) -> None:
        """The layer re-homed: new label ``j`` is old label ``columns_E[j]`` (int64
        ``[E]``). A decision still running is waited for and dropped (it judged the old
        labels), as is an offer or order not yet made; the window's loads stay,
        relabelled (:meth:`Residency.relabel`). Until the next decision, ``due`` steps
        on, the steps are served the way ``judged`` (the judgement that chose this order)
        found for them under it (``HomeOffer.serve``), else by planner calls."""
        self.settle()
        self._pending, self.home, self._ordered, self.since = None, None, None, 0
        self.residency.relabel(columns_E)
        if judged is None:
            self._verdict = Verdict(None, "call")
        else:
            self._verdict = Verdict(None, judged.serve, stale=judged.stale)

    @property
    def ordered(self) -> Refill | None:
        """The last refill handed out, until it arrives (:meth:`arrived`)."""
        return self._ordered

    def arrived(self, slot_RB: torch.Tensor) -> None:
        """A refill was swapped in: the slots serving from the next step are ``slot_RB``
        (int64 ``[R, B]``, on the host). Where they are the last ordered refill's table,
        they serve as that refill says (``Refill.serve``); any other table (the steps
        changed other slots meanwhile, or the refill was requested by hand) was judged by
        no decision, and serves by planner calls until the next one."""
        order, self._ordered = self._ordered, None
        same = order is not None and torch.equal(order.slot_RB, slot_RB.cpu())
        if same and order is not None:
            self._verdict = Verdict(None, order.serve, shares=order.shares)
        else:
            self._verdict = Verdict(None, "call")

    def _decide(self, snap: Snapshot, plan: Plan) -> Answer:
        """The decision and its counted work (host reads: here only)."""
        builds = Builds()
        cost = self.residency.cost
        verdict = self.residency.judge(snap, builds)
        forward = plan_time(cost, plan, planned=0)  # a training step: its backward too
        step_s = training_time(forward).total_s if snap.stale else forward.total_s
        steps = max(1, math.ceil(work_s(cost, builds) / step_s)) if step_s > 0 else 1
        return Answer(verdict, steps)


def time_rates(
    cost: StepCost, counts_RE: torch.Tensor, num_slots: int, repeats: int
) -> tuple[float, float]:
    """Host seconds per build and per (step, table) scored without one (``StepCost``'s
    ``decide_s`` and ``score_s``, the runtime's calibration), on a full window
    (:data:`~moonplan.plan.residency.window.WINDOW` steps) of ``counts_RE`` (int64
    ``[R, E]``) from empty slots: the two phases' medians over ``repeats`` (the window's
    scores without builds, and every (step, table) built), scaled together so that the
    decision's counted work at those rates is its median host time, overheads included
    (the tables, the host's checks). A full window, as the decisions it prices: a torch
    call costs per call as well as per step, which one step would count in full."""
    c_RE = counts_RE.detach().to(torch.int64)  # on its device: the decisions' own
    seconds, builds = time_decision(cost, [c_RE] * WINDOW, num_slots, repeats)
    per_build, per_score = time_phases(cost, c_RE, num_slots, repeats)
    counted = builds.made * per_build + builds.scored * per_score
    scale = seconds / counted if counted > 0 else 1.0
    return per_build * scale, per_score * scale


def time_phases(
    cost: StepCost, counts_RE: torch.Tensor, num_slots: int, repeats: int
) -> tuple[float, float]:
    """Median host seconds per build and per (step, table) scored without one, each phase
    timed alone on a full window of ``counts_RE`` and the tables a decision from empty
    slots scores (:func:`time_rates`). Where no table holds a replica (one rank), no
    decision builds: the build rate is then the score rate."""
    R, E = counts_RE.shape
    dev = counts_RE.device
    loads_SE = counts_RE.sum(0).expand(WINDOW, E)
    empty_RB = empty_slots(R, num_slots)
    slot_TRB, rows_SRE = candidate_tables(loads_SE.sum(0), WINDOW, empty_RB, cost, loads_SE)
    held_TRB, rows_SRE = slot_TRB[(slot_TRB >= 0).flatten(1).any(1)].to(dev), rows_SRE.to(dev)
    T = len(held_TRB)
    s_N = torch.arange(WINDOW, device=dev).repeat_interleave(T)
    t_N = torch.arange(T, device=dev).repeat(WINDOW)
    score, build = [], []
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        static_S = static_torch(cost, rows_SRE)
        if T:
            tables = tables_of(held_TRB, E)
            unbuilt_tables(cost, rows_SRE, static_S, tables)
        _sync(dev)
        t1 = time.perf_counter()
        if T:
            built_s(cost, rows_SRE[s_N], tables[1][t_N])
        _sync(dev)
        score.append((t1 - t0) / (WINDOW * (1 + T)))
        build.append((time.perf_counter() - t1) / (WINDOW * T) if T else score[-1])
    return sorted(build)[repeats // 2], sorted(score)[repeats // 2]


def time_decision(
    cost: StepCost, steps_RE: list[torch.Tensor], num_slots: int, repeats: int
) -> tuple[float, Builds]:
    """Median seconds of a decision on the window ``steps_RE`` (each int64 ``[R, E]``,
    observed in order, on the window's device) from empty slots, over ``repeats``
    decisions, and the work it counts (:class:`Builds`; the same each time)."""
    R, E = steps_RE[-1].shape
    empty_RB = empty_slots(R, num_slots)
    times, made = [], Builds()
    for _ in range(repeats):
        res = Residency(R, E, num_slots, cost, window=max(WINDOW, len(steps_RE)),
                        device=steps_RE[-1].device)  # fmt: skip
        for c_RE in steps_RE:
            res.observe(c_RE)
        builds = Builds()
        _sync(steps_RE[-1].device)
        t0 = time.perf_counter()
        res.decide_on(res.snapshot(steps_RE[-1], empty_RB.to(steps_RE[-1].device)), builds)
        times.append(time.perf_counter() - t0)
        made = builds
    return sorted(times)[len(times) // 2], made


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (timing; nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
