"""How a layer runtime plans each step for its ``balance=`` mode, and its cost model.

Legend: R ranks, E experts, ``counts_RE`` int64 ``[R, E]`` records per source rank and expert.

One planner call per step, on the counts' device, whatever the mode:

* ``"off"``: ``moonplan.plan(counts, policy="static")`` (static EP);
* ``"exact"``: ``moonplan.plan(counts, previous=...)`` (exact balance);
* ``"auto"``: ``moonplan.plan(counts, previous=..., policy="auto", cost=...)``: the
  candidate with the least predicted step time, chosen inside that call
  (``moonplan.plan.choice``). The cost model is the user's ``cost=`` if given;
  otherwise the first ``WARMUP_STEPS`` (``moonplan.runtime.config.sections``) steps
  run ``"exact"`` and are measured (the
  very first step is not: it pays one-time allocation and page faults), then the runtime
  calibrates a :class:`~moonplan.stepcost.StepCost` from those steps
  (:mod:`moonplan.runtime.calibrate`, agreed across ranks) and plans ``"auto"`` from then
  on. ``layer.calibrate()`` does the same on demand.

Every rank counts the same steps, so every rank calibrates at the same step. A step that
raises after its plan was made on some ranks only leaves the ranks' counts apart; the next
counts exchange carries each rank's count (:meth:`Balancer.schedule`) and where they
differ every rank starts the warm-up over alike (:meth:`Balancer.resync`), so the
calibration (a collective) never runs on some ranks only.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from moonplan.comm.group import EPGroup
from moonplan.plan import api as planner
from moonplan.plan.plan_type import Plan
from moonplan.plan.residency.exact_way import EXACT
from moonplan.plan.residency.refill import time_rates
from moonplan.plan.residency.serving import empty_slots, lookup_way
from moonplan.plan.residency.shares import Shares
from moonplan.runtime.calibrate import StepSample, agree, fit_rates
from moonplan.runtime.config.sections import (
    KEEP_SAMPLES,
    TIMING_REPEATS,
    WARMUP_STEPS,
    balance_mode,
)
from moonplan.stepcost import StepCost

FORCED_S = 1e9
"""A planning charge no step can beat (seconds): forces ``auto`` down one path to time it."""


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
        self.steps = 0  # forwards finished since the start or the last resync
        self._last: tuple[torch.Tensor, Plan | None] | None = None  # counts and previous

    def policy(self) -> str:
        """The planner policy of the next step: ``"static"``, ``"exact"`` or ``"auto"``."""
        if self.mode == "off":
            return "static"
        if self.mode == "exact" or self.cost is None:
            return "exact"
        return "auto"

    def plan(self, counts_RE: torch.Tensor, previous: Plan | None, rent: bool = True) -> Plan:
        """The step's plan: one planner call (the same plan on every rank for the same
        counts and ``previous``). The counts are every rank's ``bincount`` of valid ids
        and ``align`` was checked when the layer was built, so the call reads nothing on
        the host to check them again (``check_input=False``). ``rent=False``: ``auto``
        buys only what pays this step (the background refill places later steps' slots)."""
        self._last = (counts_RE, previous)
        policy = self.policy()
        return planner.plan(
            counts_RE,
            slots=self.B,
            align=self.align,
            previous=previous,
            policy=policy,
            cost=self.cost if policy == "auto" else None,
            check_input=False,
            rent=rent,
        )

    def serve(
        self,
        counts_RE: torch.Tensor,
        previous: Plan | None,
        how: str,
        shares: Shares | None = None,
    ) -> Plan:
        """The step's plan without ``auto``'s choosing call (``moonplan.runtime.placer``):
        the lookup plan ``how`` of ``previous``'s slots (``serving.lookup_plan``, or with
        ``how`` ``"weighted"`` ``serving.weighted_plan`` with the decision's ``shares``, on
        the counts' device; static EP without slots), where calls do
        not pay, or with ``how`` ``"exact"`` the exact plan with ``previous=`` (one exact
        call, ``exact_way``), where exact balance every step is predicted fastest. Reads
        nothing on the host."""
        self._last = (counts_RE, previous)
        if how == EXACT:
            return planner.plan(counts_RE, slots=self.B, align=self.align, previous=previous,
                                policy=EXACT, check_input=False)  # fmt: skip
        if previous is None:
            slot_RB = empty_slots(counts_RE.shape[0], self.B, counts_RE.device)
        else:
            slot_RB = previous.slot_expert
        return lookup_way(counts_RE, slot_RB, how, shares, align=self.align, check=False)

    def schedule(self) -> int:
        """This rank's place in the step schedule, for the counts exchange: forwards
        finished since the start or the last :meth:`resync`."""
        return self.steps

    def resync(self, schedule_R: torch.Tensor) -> bool:
        """Compare every rank's :meth:`schedule` (int64 ``[R]``, all-gathered: the same on
        every rank) and, where they differ, start the warm-up over on every rank and warn
        naming the counts; returns whether it did (the caller drops its resident slots)."""
        steps = [int(v) for v in schedule_R.tolist()]
        if len(set(steps)) == 1:
            return False
        warnings.warn(
            "balance: a step raised on some ranks after its plan was made (forwards "
            f"finished per rank: {steps}); every rank starts the calibration's warm-up "
            "over and drops its resident slots",
            RuntimeWarning,
            stacklevel=3,
        )
        self.steps = 0
        self.samples.clear()
        return True

    def record(self, sample: Callable[[], StepSample]) -> None:
        """Keep this step's measurements (every step but the first, also after a resync):
        ``sample`` makes them (``calibrate.sample_step``, with its one host read), called
        only for the steps kept."""
        self.steps += 1
        if self.steps > 1:
            self.samples.append(sample())

    def due(self) -> bool:
        """Whether ``"auto"`` should calibrate now (same answer on every rank)."""
        return self.mode == "auto" and self.cost is None and len(self.samples) >= WARMUP_STEPS

    def calibrate(self, group: EPGroup, *, copy_fallback_s: float, overlap: bool) -> StepCost:
        """Collective: fit this rank's rates, time the planner's two ``auto`` paths, the
        exact call and a slot-placement decision's host rates (``StepCost.decide_s``,
        ``score_s``) on the last step's counts, agree on the element-wise max, use it from
        now on."""
        ok = bool(self.samples) and self._last is not None
        group.agree(ok, "no measured steps yet: run a few forward steps first", what="calibrate")
        mine = fit_rates(
            list(self.samples), copy_fallback_s=copy_fallback_s, align=self.align, overlap=overlap
        )
        mine = mine.scaled(plan_s=self._time_path(mine, full=True))
        mine = mine.scaled(exit_s=self._time_path(mine, full=False))
        mine = mine.scaled(exact_s=self._time_call(policy=EXACT))
        decide_s, score_s = self._time_decision(mine)
        mine = mine.scaled(decide_s=decide_s, score_s=score_s)
        self.cost = agree(group, mine)
        self.user_cost = False
        return self.cost

    def _time_path(self, cost: StepCost, *, full: bool) -> float:
        """Median seconds of ``auto`` on the last counts, forced to build every candidate
        (``full``) or to exit early (a planning charge no step can beat on the other path)."""
        forced = cost.scaled(exit_s=FORCED_S) if full else cost.scaled(plan_s=FORCED_S)
        return self._time_call(policy="auto", cost=forced)

    def _time_call(self, **options: Any) -> float:
        """Median seconds of one planner call with ``options`` on the last counts and
        ``previous`` (the ``auto`` paths above; ``policy="exact"``: ``StepCost.exact_s``,
        the exact kernel ``auto``'s placement may serve, ``exact_way``)."""
        assert self._last is not None
        counts_RE, previous = self._last
        times = []
        for _ in range(TIMING_REPEATS):
            _sync(counts_RE.device)
            t0 = time.perf_counter()
            planner.plan(counts_RE, slots=self.B, align=self.align, previous=previous,
                         check_input=False, **options)  # fmt: skip
            _sync(counts_RE.device)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    def _time_decision(self, cost: StepCost) -> tuple[float, float]:
        """Host seconds per build and per (step, table) scored that a slot-placement
        decision counts, timed on the last counts (``refill.time_rates``; 0 without slots:
        no placement runs)."""
        assert self._last is not None
        if self.B < 1:
            return 0.0, 0.0
        return time_rates(cost, self._last[0], self.B, TIMING_REPEATS)


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (timing; nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
