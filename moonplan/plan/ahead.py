"""Choosing ahead: ``policy="auto"``'s choice made off the critical path, one step early.

Legend: R ranks, E experts, ``counts_RE`` int64 ``[R, E]`` one step's all-gathered
router counts.

``moonplan.plan(counts, policy="auto", cost=...)`` chooses *inline*: the search
(screens, scores, the candidates it builds) runs between the counts' all-gather and
the dispatch, on every step's critical path. Choosing ahead moves the search off it:

* after step ``t`` the choice runs on what step ``t`` saw, ``choose_next(counts_t,
  plan_{t-1})`` (the same search ``policy="auto"`` would have run at step ``t``),
  beside the rest of the model (a host thread in the runtime);
* step ``t + 1`` builds only the candidate that choice named, on its own counts:
  ``moonplan.plan(counts_{t+1}, previous=plan_t, policy=name)`` (one construction
  for a balancing candidate, none for ``static`` or ``resident``).

The forecast is the last step: its counts and the slots it started from, so a
candidate's fetch is judged on one real step-to-step change (with ``previous =
plan_t`` and ``counts_t`` the balancing candidates would replay ``plan_t`` and look
as if they fetched nothing). Steps before the first choice plan inline
(:meth:`AheadChoice.policy` is ``"auto"``).

Keeping the choice (``moonplan.plan.keep``) works as inline: inline ``"auto"``'s
``previous`` carries the :class:`~moonplan.plan.plan_type.Basis` of the last full
choice, while a plan built by name carries none. So :class:`AheadChoice` hands the
search ``plan_{t-1}`` with the basis of the search that named its candidate, and a
search that may keep its choice costs a keep test, not a full choice.

The search is the lean one (``moonplan.plan.search``): the same choice as inline
``"auto"``, by name, with no plan laid out (the next step builds its candidate); a
step that keeps the choice builds nothing (``Choice.planned`` is 0 where inline
``"auto"`` counts the kept candidate's construction).

Every input is all-gathered or derived from all-gathered data, so every rank names
the same candidate, as inline ``"auto"`` does.

A search longer than a step (decode steps are far shorter than a search on the host)
runs with a *lag*: the search started after step ``t`` names the candidate of step
``t + L``, not ``t + 1``, with ``L`` fixed when it starts (:func:`search_lag`, from
values every rank shares). Steps ``t + 1 .. t + L - 1`` keep building the candidate in
force, by name; step ``t + L`` takes the search (in the runtime: waits for it, a wait
only where the forecast was short), and the next search starts after it. One search
is in flight at a time. With ``L = 1`` this is the schedule above, plan for plan.

The search amortises a fetch over the horizon the replicas it fetched actually served,
measured on the plans the steps executed (:class:`~moonplan.plan.reuse.ReplicaLife`,
:meth:`AheadChoice.search_cost`), not over ``cost.horizon``, which is its cap.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

import numpy as np
import torch

from moonplan.errors import PlanError
from moonplan.plan.choose import CostModel, Inputs
from moonplan.plan.home import max_local
from moonplan.plan.plan_type import Basis, Plan
from moonplan.plan.reuse import OBSERVE_WORK, ReplicaLife
from moonplan.plan.search import Choice, search
from moonplan.plan.validate import check_options, check_previous, checked_counts

MAX_LAG = 8
"""Most steps a search may run beside (:func:`search_lag`): a choice that old is made on
counts 8 steps back. On the acceptance sweep's drifting traces (step-to-step
correlation 0.99, 8 measured steps) at 600 us a construction, a cap of 4 leaves more
wait than 8 and a cap of 16 no less (``docs/planner-policy.md``, "Choosing ahead")."""

FORECAST_CHOICES = 4
"""Full choices whose work the lag forecasts from: the largest of the last four
(:meth:`AheadChoice.lag`). A full choice's work varies 2-4x from one to the next (how
many candidates its screens let through: 3 to 12 construction equivalents on the
acceptance sweep), and a search forecast from a light one waits for the rest at the
step it names. On the acceptance sweep at 600 us a construction: 343 points within
1.01x the best peer forecasting from the last full choice, 356 from the largest of the
last 4, 356 of the last 8 (``docs/planner-policy.md``, "Choosing ahead")."""


@dataclasses.dataclass(frozen=True)
class Before:
    """What the search reads of the plan it starts from, on the host.

    Attributes:
        slot_expert: int64 ``[R, B]`` its slots (CPU).
        flow: int64 ``[R-1, 3]`` its group flows (CPU).
        policy: its candidate (the search tries it first; a kept choice names it).
        basis: the basis of the search that named it (:attr:`AheadChoice.before`).
        num_experts: ``E`` of its counts.
    """

    slot_expert: torch.Tensor
    flow: torch.Tensor
    policy: str
    basis: Basis | None
    num_experts: int

    @classmethod
    def of(cls, p: Plan) -> Before:
        """Host copies of ``p``'s slots and flows (a device read where ``p`` lives on one)."""
        cpu = torch.device("cpu")
        return cls(p.slot_expert.to(cpu), p.flow.to(cpu), p.policy, p.basis, p.num_experts)


def choose_next(
    counts_RE: object,
    before: Plan | Before | None,
    *,
    cost: CostModel,
    slots: int | None = None,
    align: int = 1,
    backend: str = "torch",
    budget: float | None = None,
) -> Choice:
    """``policy="auto"``'s choice on step ``t``'s counts from step ``t - 1``'s plan, by name.

    Args:
        counts_RE: step ``t``'s counts ``[R, E]`` (anything ``moonplan.plan`` accepts;
            read on the host).
        before: the plan of step ``t - 1``, or its host copies (:meth:`Before.of`: what a
            background thread is handed), or ``None`` (no resident slots).
        cost, slots, align: as for ``moonplan.plan``.
        backend: ``"reference"`` searches with the reference builder, ``"torch"`` and
            ``"auto"`` with the torch builder (as ``policy="auto"`` does; the two choose
            alike); ``"cuda"`` plans exact balance only and is refused, as there.
        budget: the most work the search may spend, in construction equivalents
            (:func:`search_budget`; ``moonplan.plan.choose.decide``); ``None``: none,
            the choice inline ``"auto"`` makes.

    Returns:
        The :class:`~moonplan.plan.search.Choice` of the lean search
        (``moonplan.plan.search``): the same choice inline ``"auto"`` makes at step
        ``t``; its ``policy`` names step ``t + 1``'s candidate and its
        ``planned``/``chose`` are the search's work (off the critical path).

    Raises:
        PlanError: bad counts or options, or ``before`` of another shape.
    """
    if backend not in ("auto", "torch", "reference"):
        raise PlanError(
            f"choosing ahead searches with the 'torch' or 'reference' builder; got backend "
            f"{backend!r} (the cuda backend plans exact balance only)"
        )
    c_RE, N = checked_counts(counts_RE)
    R, E = c_RE.shape
    B = check_options(slots, align, max_local(E, R), c_RE, total=N)
    prev = Before.of(before) if isinstance(before, Plan) else before
    if prev is not None:
        (R_prev, B_prev), E_prev = prev.slot_expert.shape, prev.num_experts
        check_previous((R_prev, E_prev, B_prev), (R, E, B))
    builder = "reference" if backend == "reference" else "torch"
    host = c_RE.to("cpu")
    if prev is None:
        return search(Inputs(host, B, align, None, None, builder), cost, budget=budget)
    inp = Inputs(host, B, align, prev.slot_expert, prev.flow, builder, prev.policy, prev.basis)
    return search(inp, cost, budget=budget)


def search_lag(work: float | None, step_s: float | None, search_s: float, max_lag: int) -> int:
    """``L``: how many steps ahead a search starting now names its candidate.

    ``L = min(max_lag, max(1, ceil(work * search_s / step_s)))``: the forecast of the
    search's host time (construction equivalents ``work``, ``Choice.planned +
    Choice.chose`` of recent full choices: :meth:`AheadChoice.lag` passes the largest of
    the last :data:`FORECAST_CHOICES`, at ``search_s`` host seconds each) over the
    predicted step time ``step_s`` of the last full choice's winner. ``1`` before any search
    finished (``work`` is ``None``) or without a positive step time. Every argument is
    the same on every rank, so every rank picks the same ``L``.

    Raises:
        ValueError: ``max_lag < 1`` or ``search_s < 0``.
    """
    if max_lag < 1 or search_s < 0:
        raise ValueError(f"need max_lag >= 1 and search_s >= 0, got {max_lag}, {search_s}")
    if work is None or step_s is None or step_s <= 0:
        return 1
    return min(max_lag, max(1, math.ceil(work * search_s / step_s)))


def search_budget(lag: int, step_s: float | None, search_s: float) -> float | None:
    """The most work (construction equivalents) a search with lag ``lag`` may spend:
    what ``search_s`` host seconds each fit in ``lag`` steps of ``step_s`` (the last full
    choice's predicted step), ``lag * step_s / search_s``; ``None`` (no limit) before any
    step time is known or with ``search_s = 0``. Every argument is the same on every
    rank, so every rank's search stops at the same candidate.

    The lag is forecast from recent full choices (:func:`search_lag`), but a choice's
    work varies 2-4x (how many candidates its screens let through), and a search longer
    than its lag makes the step it names wait. With this budget it leaves out the last
    balancing candidates instead (``Choice.cut``): the setup and the fetch-free
    candidates (static, resident) are always spent, then the balancing ones in build
    order (the candidate in force first) while they fit; a budget under about 4.6
    construction equivalents scores no balancing candidate at all. At ``max_lag`` steps,
    where even the forecast does not fit, the budget is what does."""
    if step_s is None or step_s <= 0 or search_s <= 0:
        return None
    return lag * step_s / search_s


def plan_rows(p: Plan) -> np.ndarray:
    """int64 numpy ``[R, 3B + 2D]``: each rank's new-slot flags ``[B]``, slots' experts
    ``[B]`` and direct rows' experts ``[D]`` (``-1``: none), then the records of each slot
    and direct row ``[B + D]`` (``Plan.row_count``), in one host read (a device-to-host
    copy where ``p`` lives on an accelerator). The layer reads these once a step for its
    fetch list (``moonplan.runtime.fetch_list``, the first ``2B + D`` columns) and hands
    the same rows to the measured horizon."""
    M = p.max_local
    parts = [p.slot_new.to(torch.int64), p.slot_expert, p.direct_expert(), p.row_count[:, M:]]
    return torch.cat(parts, 1).cpu().numpy()


def executed_rows(
    rows: np.ndarray, num_slots: int, num_experts: int
) -> tuple[np.ndarray, np.ndarray]:
    """What :class:`~moonplan.plan.reuse.ReplicaLife` reads of an executed plan, from its
    :func:`plan_rows`: the replicas off their home it sends records to (bool numpy
    ``[E, R]``: slots and direct rows with records) and those whose weights it copies
    this step (bool numpy ``[E, R]``: its new slots and its direct rows with records, as
    ``moonplan.stepcost.plan_fetch_ER``)."""
    B, (R, W) = num_slots, rows.shape
    D = (W - 3 * B) // 2
    new_RB, slot_RB, direct_RD = rows[:, :B] > 0, rows[:, B : 2 * B], rows[:, 2 * B : 2 * B + D]
    count_RB, count_RD = rows[:, 2 * B + D : 3 * B + D], rows[:, 3 * B + D :]
    used_ER = np.zeros((num_experts, R), dtype=bool)
    fetch_ER = np.zeros((num_experts, R), dtype=bool)
    r_N, j_N = ((slot_RB >= 0) & (count_RB > 0)).nonzero()
    used_ER[slot_RB[r_N, j_N], r_N] = True
    fetch_ER[slot_RB[r_N, j_N], r_N] = new_RB[r_N, j_N]
    r_N, j_N = ((direct_RD >= 0) & (count_RD > 0)).nonzero()
    used_ER[direct_RD[r_N, j_N], r_N] = fetch_ER[direct_RD[r_N, j_N], r_N] = True
    return used_ER, fetch_ER


def executed(p: Plan) -> tuple[np.ndarray, np.ndarray]:
    """:func:`executed_rows` of ``p``'s :func:`plan_rows`."""
    return executed_rows(plan_rows(p), p.num_slots, p.num_experts)


def inline_choice(p: Plan) -> Choice:
    """The choice inline ``"auto"`` made for ``p`` (a finished search: its name, scores,
    work and basis), to put in force with :meth:`AheadChoice.take`."""
    return Choice(p.policy, p.predicted, p.planned, p.chose, p.basis)


class AheadChoice:
    """One layer's choose-ahead state: the candidate in force and the search in flight.

    Args:
        search_s: host seconds per construction equivalent of a search (the same on
            every rank); ``0``: every search names the next step (``L = 1``).
        max_lag: the most steps ahead a search names (:func:`search_lag`).

    Per step ``t``: ``p = plan(counts, previous=last, policy=ahead.policy(), cost=cost)``
    on the critical path, then, in the caller, ``ahead.update(counts, p, previous=last,
    cost=cost)``: records ``p``, starts a search when none is in flight (it names step
    ``t + L``) and puts a search's candidate in force once the next step is the one it
    names. A runtime running the search elsewhere makes the same calls apart:
    :meth:`start` (what the search starts from, before the step's plan), :meth:`record`
    (the step's plan), :meth:`launch` (a search starts, its lag), :meth:`due` and
    :meth:`take` (at the step it names, before that step's plan).
    """

    def __init__(self, *, search_s: float = 0.0, max_lag: int = MAX_LAG) -> None:
        search_lag(None, None, search_s, max_lag)  # checks the options
        self.search_s, self.max_lag = float(search_s), int(max_lag)
        self.last_lag = 1  # the lag of the last search started
        self.last_budget: float | None = None  # its work budget (search_budget)
        self.last_pending = 0  # steps whose measure update runs before it (launch())
        self._before: Plan | None = None  # the last recorded plan, basis handed on
        self._next: str | None = None  # the candidate in force
        self._next_basis: Basis | None = None  # the basis of the search that named it
        self._steps = 0  # steps recorded
        self._launched = 0  # steps recorded when the last search started
        self._due: int | None = None  # the step the search in flight names
        self._held: Choice | None = None  # update(): the search run, until it is due
        # the work of the last FORECAST_CHOICES full choices taken (the first: any choice)
        self._works: deque[float] = deque(maxlen=FORECAST_CHOICES)
        self._step_s: float | None = None  # its winner's predicted step (last known)
        self.life = ReplicaLife()  # how long the executed plans' fetched replicas served

    @property
    def before(self) -> Plan | None:
        """The plan of the last recorded step, with the basis of the search that named its
        candidate (what inline ``auto``'s previous plan carries: the keep test reads it):
        what the next search starts from."""
        return self._before

    @property
    def searching(self) -> bool:
        """Whether a search is in flight (started, not yet taken)."""
        return self._due is not None

    def policy(self) -> str:
        """The ``policy=`` of the next step: the candidate in force, or ``"auto"`` before
        the first choice (inline)."""
        return "auto" if self._next is None else self._next

    def due(self) -> bool:
        """Whether the next step is the one the search in flight names (take it first)."""
        return self._due is not None and self._steps >= self._due

    def search_cost(self, cost: CostModel) -> CostModel:
        """The cost model a search starting now scores with: ``cost`` with its
        ``horizon`` (the cap) replaced by the one measured on the plans recorded so far
        (:class:`~moonplan.plan.reuse.ReplicaLife`); ``cost`` itself for a model without
        a ``horizon`` field (a plain object: every fetch counted in full)."""
        cap = getattr(cost, "horizon", None)
        if cap is None or not dataclasses.is_dataclass(cost) or isinstance(cost, type):
            return cost
        return dataclasses.replace(cost, horizon=self.life.horizon(float(cap)))

    def lag(self) -> int:
        """:func:`search_lag` of a search starting now: the largest work of the last
        :data:`FORECAST_CHOICES` full choices taken over the last one's predicted step."""
        work = max(self._works) if self._works else None
        return search_lag(work, self._step_s, self.search_s, self.max_lag)

    def update(
        self,
        counts_RE: object,
        p: Plan,
        *,
        previous: Plan | None,
        cost: CostModel,
        slots: int | None = None,
        align: int = 1,
        backend: str = "torch",
    ) -> Choice | None:
        """The in-caller schedule after step ``t`` (plan ``p``, built from ``previous``):
        record ``p`` (:meth:`record`); when a search starts, run it now (from
        :meth:`start` of ``previous``, on ``counts_RE``: the search inline ``"auto"``
        would run at this step), naming step ``t + L``; put it in force once the next
        step is the one it names (at once with ``L = 1``). Returns the search run now
        (its work, its scores), ``None`` when none started (one in flight, or ``p`` was
        chosen inline)."""
        start = self.start(previous)
        found = None
        if self.record(p):
            self.launch()
            found = choose_next(
                counts_RE,
                start,
                cost=self.search_cost(cost),
                slots=slots,
                align=align,
                backend=backend,
                budget=self.last_budget,
            )
            self._held = found
        if self.due():
            held, self._held = self._held, None
            assert held is not None, "update() holds the search it started"
            self.take(held)
        return found

    def start(self, previous: Plan | None) -> Plan | None:
        """What the search of a step built from ``previous`` starts from: :attr:`before`
        (``previous`` with the basis handed on) when it is that plan, else ``previous``
        itself (no step recorded yet, after :meth:`reset`, or residents dropped)."""
        b = self._before
        if previous is None or b is None or b.alloc is not previous.alloc:
            return previous
        return b

    def record(self, p: Plan, *, observe: bool = True) -> bool:
        """Record ``p`` as this step's plan (once per step, after its last plan); returns
        whether a search starts after this step (:meth:`launch`).

        The replicas ``p`` executes and fetches feed the measured horizon
        (:attr:`life`, :func:`executed` of ``p``); ``observe=False`` leaves feeding it to
        the caller (the runtime does, in its search thread, from the rows its fetch list
        reads).

        ``p`` keeps its own basis when it was chosen inline (no candidate in force), else
        it takes the basis of the search that named its candidate. An inline choice is
        this step's search (the same counts, the same previous plan): it is put in force
        (:meth:`take`) and no search starts after it; otherwise one starts when none is
        in flight."""
        inline = self._next is None
        own = p.basis if inline else self._next_basis
        self._before = p if own is p.basis else dataclasses.replace(p, basis=own)
        self._steps += 1
        if observe:  # else the caller feeds self.life itself (the runtime: in its thread)
            self.life.observe(*executed(p))
        if inline:
            self.take(inline_choice(p))
        return not inline and not self.searching

    def launch(self) -> int:
        """A search starts after the step just recorded; returns its lag ``L`` (it names
        the step ``L`` after that one: :meth:`due` there) and sets :attr:`last_budget`,
        the work it may spend (:func:`search_budget`, less the measure's updates of the
        :attr:`last_pending` steps recorded since the last search, which run first in
        the same thread, ``OBSERVE_WORK`` each: pass it to :func:`choose_next`)."""
        assert not self.searching, "one search in flight at a time"
        self.last_lag = self.lag()
        budget = search_budget(self.last_lag, self._step_s, self.search_s)
        # the measure's updates of the steps since the last search run first, in the
        # same thread (moonplan.runtime.balancer; the simulator charges them alike)
        self.last_pending = pending = self._steps - self._launched
        self.last_budget = None if budget is None else max(0.0, budget - pending * OBSERVE_WORK)
        self._launched = self._steps
        self._due = self._steps - 1 + self.last_lag
        return self.last_lag

    def take(self, found: Choice) -> None:
        """Put ``found``'s candidate in force (from the next step on; at the step the
        search in flight names, or an inline choice, :func:`inline_choice`) and remember,
        for the next lag, the work of the *full* choices (the last
        :data:`FORECAST_CHOICES`) and the last one's winner's predicted step. A kept
        choice (it scores nothing) changes neither: the next search may be a full choice
        again (the keep rule lets go after a few steps or a moved load), and forecasting
        it from a keep test's 0.2 constructions would give ``L = 1`` to a search of 4-12
        (measured on the acceptance sweep at 600 us a construction, each wait then
        charged to the step that started the search: 307 points within 1.01x the best
        peer forecasting from the last search taken, 322 from the last full choice,
        ``docs/planner-policy.md``)."""
        self._next, self._next_basis, self._due = found.policy, found.basis, None
        if found.policy in found.predicted or not self._works:
            self._works.append(found.planned + found.chose)
        if found.policy in found.predicted:
            self._step_s = found.predicted[found.policy]

    def reset(self) -> None:
        """Forget the history (the next step chooses inline, the next lag is 1)."""
        self._before, self._next, self._next_basis = None, None, None
        self._steps, self._due, self._held, self._launched = 0, None, None, 0
        self._works.clear()
        self._step_s, self.last_lag, self.last_budget, self.last_pending = None, 1, None, 0
        self.life.reset()
