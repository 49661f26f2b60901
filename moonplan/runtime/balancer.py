"""How a layer runtime plans each step for its ``balance=`` mode, and its cost model.

Legend: R ranks, E experts, ``counts_RE`` int64 ``[R, E]`` records per source rank and expert,
``schedule_RS`` int64 ``[R, 2]`` every rank's place in the step schedule (S: forwards
finished, steps recorded; :meth:`Balancer.schedule`).

* ``"off"``: ``static_plan`` (every record on its home rank);
* ``"exact"``: ``moonplan.plan`` (exact balance, the planner's default policy);
* ``"auto"``: ``moonplan.plan(..., policy="auto", cost=...)``: the candidate with the
  least predicted step time. The cost model is the user's ``cost=`` if given;
  otherwise the first :data:`WARMUP_STEPS` steps run ``"exact"`` and are measured
  (the very first step is not: it pays one-time allocation and page faults), then the
  runtime calibrates a :class:`~moonplan.stepcost.StepCost` from those steps
  (:mod:`moonplan.runtime.calibrate`, agreed across ranks) and plans ``"auto"`` from
  then on. ``layer.calibrate()`` does the same on demand.

Choosing ahead (``choose="ahead"``, the layer's default on an accelerator:
:func:`default_choose`; :mod:`moonplan.plan.ahead`). Once
``"auto"`` has a cost model, its candidate search (screens, scores, the candidates it
builds) leaves the critical path. Right after step ``t``'s plan is made, step ``t``'s
search, ``choose_next(counts_t, previous_t)`` (what inline ``"auto"`` would run at step
``t``), is submitted (:meth:`Balancer.search`, once the step's routing is done) to a
host thread the balancer owns (a ``"thread"``
:class:`~moonplan.runtime.background.BackgroundLane`, joined by :meth:`Balancer.close`)
on host copies of the counts and of the previous plan's slots and flows
(:class:`~moonplan.plan.ahead.Before`, taken in :meth:`Balancer.plan`, where the counts
are read anyway: the thread never touches a device tensor). It scores with the horizon
measured on the plans recorded so far (:meth:`AheadChoice.search_cost`,
:mod:`moonplan.plan.reuse`: how many steps the fetched replicas actually served, capped
by the cost model's ``horizon``), read from each step's plan in :meth:`Balancer.plan`
and updated in the thread (each search job first observes the steps since the last).
It is the lean search (``moonplan.plan.search``: the candidate's name, no plan laid
out, nothing built on a step that keeps the choice); it runs beside the rest of step
``t`` (dispatch, experts, combine, backward) and of the model. It names the candidate
of step ``t + L`` (:func:`~moonplan.plan.ahead.search_lag`: ``L = 1`` unless the largest work of the
last four full choices at ``search_s`` host seconds per construction equivalent, the layer's
``search_us``, forecasts it longer than its winner's predicted step; at most
``max_lag``). Steps ``t + 1 .. t + L - 1`` build the candidate in force, by name, and
wait for nothing; step ``t + L`` waits for the search before its counts exchange
(:meth:`Balancer.collect`: the wait is the phase ``choice_exposed``, the search's own
time ``choice``) and builds only the candidate it named: ``moonplan.plan(counts_{t+L},
previous=plan_{t+L-1}, policy=name)``; the next search starts after it (one in flight
at a time). The first ``"auto"`` step, the first after the cost model changes
(calibration), the first after a failed counts exchange and a step that resynchronises
(see "Failures" below) choose inline; that search
is the step's own (the same counts, the same previous plan), so none starts after it:
its choice is in force until the search started after the next step is due.
``choose="inline"`` runs the search on every step's critical path. The thread runs
planner code only, never a collective.

Every rank counts the same steps (every rank runs every forward, :class:`AheadChoice`
counts them) and agrees on one model and ``search_us``, so every rank picks the same
``L`` and waits at the same step; the search reads only all-gathered counts and plans
that are equal on every rank, so every rank computes the same plan and names the same
candidate.

Failures: every rank fails alike, at the same step.

* A search that raises (whatever its lag) is reported by :meth:`Balancer.collect`, at
  the step it names, as this rank's failure in that step's counts exchange: every rank
  raises the same ``ContractError`` naming the rank, and every rank forgets the search
  and its named candidate (:meth:`Balancer.restart`); the next step chooses inline.
* Calibration (``layer.calibrate()``, a collective, or the automatic one) waits for a
  search in flight, drops it and the named candidate on every rank
  (:meth:`Balancer.calibrate`); the next step chooses inline with the agreed model.
* A step that raises *after* its plan was made on some ranks only (before their search
  is recorded and started, :meth:`Balancer.search`, on some; after it, or after the
  step's collectives, on others) leaves the ranks at different places in the schedule.
  The next counts exchange carries each rank's place (:meth:`Balancer.schedule`:
  forwards finished, steps recorded); where they differ, every rank resynchronises
  alike (:meth:`Balancer.resync`: a ``RuntimeWarning`` naming the counts, the search
  in flight, the named candidate and the measured steps forgotten, the resident slots
  dropped): that step chooses inline (or the warm-up starts over) on every rank. The
  automatic calibration is decided after that comparison, so it never runs on some
  ranks only. This covers every rank reaching the next exchange: a rank raising before
  a collective of the step that its peers entered leaves them waiting in it (a hang
  until the group's timeout, as any rank skipping a collective; ``docs/reliability.md``).
"""

from __future__ import annotations

import time
import warnings
from collections import deque

import numpy as np
import torch

from moonplan.comm.group import EPGroup
from moonplan.plan import api as planner
from moonplan.plan.ahead import (
    MAX_LAG,
    AheadChoice,
    Before,
    choose_next,
    executed_rows,
    plan_rows,
)
from moonplan.plan.plan_type import Plan
from moonplan.plan.static import static_plan
from moonplan.profiling.hooks import NULL_PROFILER, StepHooks
from moonplan.runtime.background import BackgroundLane, Pending
from moonplan.runtime.balance import balance_mode
from moonplan.runtime.calibrate import StepSample, agree, fit_rates, sample_step
from moonplan.stepcost import StepCost

Made = tuple[torch.Tensor | None, Before | None, Plan]
"""What :meth:`Balancer.plan` keeps for :meth:`Balancer.search`: host counts (when a search
starts after the step), the plan the search starts from, and the step's plan."""

WARMUP_STEPS = 4
"""Measured exact steps before ``"auto"`` calibrates its own cost model."""

KEEP_SAMPLES = 32
"""Most recent step samples kept for ``calibrate()``."""

SEARCH_US = 600.0
"""Host microseconds per construction equivalent of the choose-ahead search: the lean
search measured on this project's CPU at 323-599 us (``bench/bench_search.py``), rounded
up; the default of ``MoEConfig.search_us`` (what the lag forecasts with)."""

CHOOSE_MODES = ("ahead", "inline")
"""Where ``balance="auto"`` runs its candidate search (see the module docstring)."""


def choose_mode(value: object) -> str | None:
    """``value`` if it is one of :data:`CHOOSE_MODES` or ``None`` (the default: the
    layer picks by its device, :func:`default_choose`).

    Raises:
        ValueError: naming the option and the allowed values.
    """
    if value is not None and (not isinstance(value, str) or value not in CHOOSE_MODES):
        raise ValueError(f"choose must be one of {CHOOSE_MODES} or None, got {value!r}")
    return value


def default_choose(device: torch.device) -> str:
    """``choose=None``'s mode on ``device``: ``"ahead"`` where an accelerator runs the
    step while the host thread searches, ``"inline"`` on the CPU, where the step's own
    work and the search share the same cores and the GIL (measured slower ahead there:
    ``docs/runtime.md``, "Choosing ahead")."""
    return "inline" if device.type == "cpu" else "ahead"


class Balancer:
    """Plans one layer's steps for a ``balance=`` mode (see the module docstring).

    Args:
        mode: ``"auto"``, ``"exact"`` or ``"off"``.
        slots: ``B``; align: receive-row padding.
        cost: a fixed cost model for ``"auto"`` (no calibration), or ``None``.
        choose: ``"ahead"`` (the search of ``"auto"`` off the critical path) or ``"inline"``.
        search_s: host seconds per construction equivalent of the search (the same on
            every rank): what the lag forecasts with (module docstring).
        max_lag: the most steps ahead a search names.

    Attributes:
        how: how the last plan's candidate was chosen: ``"ahead"`` (named by the
            previous step's background search), ``"inline"`` (searched on the critical
            path) or ``"none"`` (``"exact"``/``"off"``, and ``"auto"``'s warm-up).
        figures: the last :meth:`collect`'s phases in seconds: ``choice_exposed`` (the
            wait) and ``choice`` (the search's own time); empty when nothing was waited for.
    """

    def __init__(
        self,
        mode: str,
        *,
        slots: int,
        align: int,
        cost: StepCost | None = None,
        choose: str = "ahead",
        search_s: float = SEARCH_US * 1e-6,
        max_lag: int = MAX_LAG,
    ):
        self.mode = balance_mode(mode)
        resolved = choose_mode(choose)
        if resolved is None:  # the layer resolves None by its device (default_choose)
            raise ValueError("Balancer needs choose='ahead' or 'inline'")
        self.choose: str = resolved
        self.B, self.align = slots, align
        self.cost = cost
        self.user_cost = cost is not None
        self.samples: deque[StepSample] = deque(maxlen=KEEP_SAMPLES)
        self.steps = 0  # forwards finished since the start or the last resync
        self.recorded = 0  # steps recorded for choosing ahead (search()), likewise
        self.ahead = AheadChoice(search_s=search_s, max_lag=max_lag)
        self.how = "none"
        self.figures: dict[str, float] = {}
        self._lane = BackgroundLane("thread", torch.device("cpu"), name="moonplan-choose")
        self._search: Pending | None = None  # the search in flight
        # to record (and search from, when a search starts): host counts, the start, plan
        self._made: Made | None = None
        # choosing ahead: the host rows (plan_rows, B, E) of the steps recorded since the
        # last search started, for the next search job to observe first (the thread alone
        # updates the measure)
        self._unseen: list[tuple[np.ndarray, int, int]] = []

    def policy(self) -> str:
        """The planner policy of the next step: ``"static"``, ``"exact"`` or ``"auto"``."""
        if self.mode == "off":
            return "static"
        if self.mode == "exact" or self.cost is None:
            return "exact"
        return "auto"

    def plan(self, counts_RE: torch.Tensor, previous: Plan | None) -> Plan:
        """The step's plan (the same on every rank for the same counts).

        ``"auto"`` choosing ahead builds the candidate named by the search that
        :meth:`collect` waited for (inline ``"auto"`` when there is none) and keeps
        what this step's search needs for :meth:`search`; call :meth:`collect` once per
        step before it. ``"auto"`` scores with the horizon measured on the plans recorded
        so far (:meth:`AheadChoice.search_cost`) whether it chooses inline or ahead;
        :meth:`search` records the step's plan for that measure.
        """
        policy = self.policy()
        self.how = "none"
        if policy == "static":
            return static_plan(counts_RE, slots=self.B, align=self.align)
        if policy == "exact":
            return planner.plan(counts_RE, slots=self.B, align=self.align, previous=previous)
        assert self.cost is not None, "'auto' plans with a cost model (policy())"
        name = self.ahead.policy() if self.choose == "ahead" else "auto"
        counts_host, start = None, None
        if self.choose == "ahead" and not self.ahead.searching:  # a search starts after
            # this step: host copies now (the counts are read on the host here anyway,
            # their validation, and the plan the search starts from, the step before's,
            # is long made, so neither waits for device work); none on the steps a
            # search in flight spans
            counts_host = counts_RE.detach().to("cpu", copy=True)
            before = self.ahead.start(previous)
            start = None if before is None else Before.of(before)
        p = planner.plan(
            counts_RE,
            slots=self.B,
            align=self.align,
            previous=previous,
            policy=name,
            # inline "auto": the measured horizon (choosing ahead, the thread holds it
            # until a restart drains it, and only an inline step after one reads it here)
            cost=self.ahead.search_cost(self.cost) if name == "auto" else self.cost,
        )
        self.how = "inline" if name == "auto" else "ahead"
        self._made = (counts_host, start, p)  # the last call of a step wins (growth)
        return p

    def search(self, rows: np.ndarray | None = None) -> None:
        """Record the step just planned (``"auto"``: its plan feeds the measured horizon)
        and, when no search is in flight, start its search in the thread (only where
        ``"auto"`` chooses ahead). Call once per step,
        after its last :meth:`plan` and the host work that follows it on the critical
        path (routing), so that the search runs beside the dispatch and the experts
        rather than competing with it. ``rows``: the step plan's
        :func:`~moonplan.plan.ahead.plan_rows` where the caller already read them (the
        layer does, for its fetch list), else they are read here."""
        if self._made is None:
            return
        self.recorded += 1  # this rank's place in the schedule (schedule())
        # host copies (plan()): the counts, and the slots, flows, policy and basis of the
        # plan this step replayed, with the basis of the search that named its candidate
        # (so it may keep its choice, as inline does); nothing the step writes later
        (counts, before, p), self._made = self._made, None
        # the plan's host rows for the measured horizon: the fetch list's read (``rows``,
        # passed by the layer), else read here
        read = (plan_rows(p) if rows is None else rows, p.num_slots, p.num_experts)
        if self.choose == "inline":  # no search: only the measured horizon's update
            self.ahead.life.observe(*executed_rows(*read))
            return
        # the measure's update runs in the thread, off the critical path: the next
        # search job first observes every step's plan since the last one (in order)
        self._unseen.append(read)
        if not self.ahead.record(p, observe=False):  # one in flight, or this step inline
            return
        assert counts is not None, "plan() takes the host copies when no search is in flight"
        self.ahead.launch()
        assert self.cost is not None, "only 'auto' with a cost model searches"
        ahead, base, B, align = self.ahead, self.cost, self.B, self.align
        budget = self.ahead.last_budget  # the work that fits beside its lag's steps
        batch, self._unseen = self._unseen, []

        def run() -> object:  # in the thread: the horizon measured on every plan so far
            for r in batch:
                ahead.life.observe(*executed_rows(*r))
            cost = ahead.search_cost(base)
            return choose_next(counts, before, cost=cost, slots=B, align=align, budget=budget)

        self._search = self._lane.submit(run)

    def collect(self, rec: StepHooks = NULL_PROFILER) -> str:
        """Wait for the search in flight if this step is the one it names; ``""``, or why
        it failed (``""`` at once on the steps in between).

        Call on every rank once per step, before the counts exchange, and report a
        failure there (the step's ``ok``/``msg``). Records the phases ``choice_exposed``
        (the wait, on the critical path) and ``choice`` (the search's own time, in the
        background) in :attr:`figures` and through ``rec``.
        """
        self.figures = {}
        if self._search is None or not self.ahead.due():
            return ""
        pending, self._search = self._search, None
        t0 = time.perf_counter()
        try:
            found = pending.wait()
        except Exception as exc:  # reported to every rank by the counts exchange
            self.restart()
            return f"balance='auto' choosing ahead failed: {type(exc).__name__}: {exc}"
        t1 = time.perf_counter()
        self.ahead.take(found)
        rec.span("choice_exposed", t0, t1)
        rec.background("choice", *pending.span, host=True)
        self.figures = {"choice_exposed": t1 - t0, "choice": pending.run_s}
        return ""

    def restart(self) -> None:
        """Forget the submitted search and the named candidate: the next ``"auto"`` step
        chooses inline (after a cost model change or a failed counts exchange, on every
        rank)."""
        self._lane.drain()
        self._search = self._made = None
        self._unseen = []
        self.ahead.reset()

    def schedule(self) -> tuple[int, int]:
        """This rank's place in the step schedule, for the counts exchange: forwards
        finished (:meth:`record`) and steps recorded for choosing ahead (:meth:`search`),
        since the start or the last :meth:`resync`. Equal on every rank unless a step
        raised on some ranks only after its plan was made (module docstring, "Failures")."""
        return self.steps, self.recorded

    def resync(self, schedule_RS: torch.Tensor) -> bool:
        """Compare every rank's :meth:`schedule` (``[R, 2]`` int64, all-gathered: the same
        on every rank) and, where they differ, resynchronise: forget the search in flight
        and the named candidate (:meth:`restart`), the counters and the measured steps
        (the warm-up starts over), and warn naming the ranks; returns whether it did (the
        caller then drops its resident slots too). Every rank decides alike."""
        rows = [tuple(int(v) for v in row) for row in schedule_RS.tolist()]
        if len(set(rows)) == 1:
            return False
        warnings.warn(
            "balance: a step raised on some ranks after its plan was made (forwards "
            f"finished, steps recorded per rank: {rows}); every rank resynchronises: "
            "the named candidate, the measured steps and the resident slots are dropped",
            RuntimeWarning,
            stacklevel=3,
        )
        self.restart()
        self.steps = self.recorded = 0
        self.samples.clear()
        return True

    def close(self) -> None:
        """Wait for a running search (its result and errors dropped), join the thread."""
        self.restart()
        self._lane.close()

    def record(self, plan: Plan, rank: int, sent: int, phases: dict[str, float]) -> None:
        """Keep this step's measurements (every step but the first, also after a resync)."""
        self.steps += 1
        if self.steps > 1:
            self.samples.append(sample_step(plan, rank, sent, phases))

    def due(self) -> bool:
        """Whether ``"auto"`` should calibrate now (same answer on every rank)."""
        return self.mode == "auto" and self.cost is None and len(self.samples) >= WARMUP_STEPS

    def calibrate(self, group: EPGroup, *, copy_fallback_s: float, overlap: bool) -> StepCost:
        """Collective: fit this rank's rates, agree on the max, use it from now on (the
        next ``"auto"`` step chooses inline with it)."""
        ok = bool(self.samples)
        group.agree(ok, "no measured steps yet: run a few forward steps first", what="calibrate")
        mine = fit_rates(
            list(self.samples), copy_fallback_s=copy_fallback_s, align=self.align, overlap=overlap
        )
        self.cost = agree(group, mine)
        self.user_cost = False
        self.restart()
        return self.cost
