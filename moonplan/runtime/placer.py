"""The runtime's side of replicas that stay: watch the steps, order refills when they pay.

Legend: R ranks, E experts, B slots per rank, S staging rows per rank.

With ``balance="auto"`` and a cost model, every step's counts go to a
:class:`~moonplan.plan.residency.refill.Residency` (the simulator's ``moonplan-auto`` runs
the same one, under the same :class:`~moonplan.plan.residency.refill.Decisions` rule). A
decision (which slot table the window's loads want, and whether rent or buy says a refill
pays) starts from a snapshot of one step, runs on the process's one decision worker
(:func:`decision_worker`, shared by every layer) beside the next ``k`` steps and is used
``k`` steps later (the step waits for it only if it is not done); ``k`` is the fewest steps
whose predicted time covers its work (the builds of the ``resident`` candidate it makes and
the (step, table) pairs it scores, counted as it runs, at the host's rates
``cost.decide_s`` and ``cost.score_s``, which the calibration times:
``moonplan.plan.residency.work``). Every input is agreed (the counts, the cost model, the
plans), so every rank decides alike at the same step.

An ordered refill waits in the shared staging rows' line
(:class:`~moonplan.runtime.staging.StagingPool`, asking every step) until its turn, and no
refill of this layer is in flight (one requested by hand), and is then handed to
:meth:`~moonplan.runtime.layer_runtime.LayerRuntime.request_refill`; while it waits or
copies, no decision starts. The snapshot is taken on the device; the worker reads it on
the host.

One worker for every layer: the layers' decisions run one after another, never beside each
other. A layer's steps come once per model step, with the other layers' in between, so
where the layers are alike a decision whose work covers ``k`` of its layer's steps is done
within those ``k`` model steps even behind one decision of every other layer: the
simulator's charge (``k`` of one layer's steps, as if the layer had the host alone) bounds
the queue (docs/simulator.md, assumptions).

While refills run in the background, each step's planner call buys only what pays in that
step (``moonplan.plan(..., rent=False)``): the slots for later steps are the refill's.
Where a decision says another way is faster over its window than a planner call every
step (``Decisions.way``), the steps serve it (:meth:`Placer.serve`): one of the slots'
lookup plans without a call, or the exact kernel every step; until a later decision says
otherwise, and only on steps like those it was judged for (slots that stay, or that go
stale as in training).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moonplan.plan.plan_type import Plan
from moonplan.plan.residency.home_choice import HomeOffer
from moonplan.plan.residency.refill import Answer, Decisions, Residency
from moonplan.plan.residency.shares import Shares
from moonplan.runtime.staging import StagingPool
from moonplan.stepcost import StepCost

_WORKER: tuple[int, ThreadPoolExecutor] | None = None  # (the process id, its worker)


def decision_worker() -> ThreadPoolExecutor:
    """The process's one slot-placement decision thread, shared by every layer (made on
    first use; a forked child makes its own: the parent's thread is not in it)."""
    global _WORKER
    if _WORKER is None or _WORKER[0] != os.getpid():
        _WORKER = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="moonplan-placer"))
    return _WORKER[1]


def _submit(job: Callable[[], Answer]) -> Future[Answer]:
    """``job`` on this process's decision worker (looked up at each call: a placer made
    before a fork submits to the child's own worker)."""
    return decision_worker().submit(job)


class Placer:
    """One layer's residency, its decisions and the refill it ordered (module docstring).

    Args:
        num_slots: ``B``; staging: ``S`` (no refill without both).

    Attributes:
        orders: refills ordered so far; waiting: the target ``[R, B]`` of the ordered
            refill waiting for its turn (``None``: none).
    """

    def __init__(self, num_slots: int, staging: int):
        self.B, self.S = num_slots, staging
        self.decisions: Decisions | None = None
        self.orders = 0
        self.waiting: torch.Tensor | None = None
        self._shares: tuple[Shares, Shares] | None = None  # (host, device)

    @property
    def residency(self) -> Residency | None:
        """The residency (``None`` until the first step with a cost model)."""
        return None if self.decisions is None else self.decisions.residency

    def serve(self, stale: bool = False) -> str:
        """How the step is served: ``"call"`` (the planner), or the way the last decision
        judged faster over the window for such a step (``stale``: its slots went stale,
        as at every training step): a lookup of the slots or the exact kernel
        (``Decisions.way``; :meth:`~moonplan.runtime.balancer.Balancer.serve`)."""
        return "call" if self.decisions is None else self.decisions.way(stale)

    def shares(self, stale: bool, device: torch.device) -> Shares | None:
        """The weighted lookup's ``Shares`` on ``device`` where :meth:`serve` is that
        lookup (``Decisions.shares``), else ``None``; copied to the device once per
        verdict, not every step."""
        host = None if self.decisions is None else self.decisions.shares(stale)
        if host is None:
            return None
        if self._shares is None or self._shares[0] is not host:
            self._shares = (host, host.to(device))
        return self._shares[1]

    def arrived(self, slot_RB: torch.Tensor) -> None:
        """A refill was committed: ``slot_RB`` (int64 ``[R, B]``, on the host) serves from
        the next step, the way its decision judged (``Decisions.arrived``)."""
        if self.decisions is not None:
            self.decisions.arrived(slot_RB)

    def active(self, cost: StepCost | None) -> bool:
        """Whether refills are placed (``auto`` with a cost model, slots and staging)."""
        return cost is not None and self.B >= 1 and self.S >= 1

    def after_step(
        self,
        counts_RE: torch.Tensor,
        plan: Plan,
        cost: StepCost | None,
        in_flight: bool,
        pool: StagingPool,
        ticket: object,
        stale: bool = False,
        move_bytes: float = 0.0,
    ) -> torch.Tensor | None:
        """Observe a finished step (its counts and plan, whose slots now serve); the
        refill target ``[R, B]`` to request now (``-1``: keep), or ``None``. A refill it
        orders joins ``pool``'s line as ``ticket`` (the layer's refill, which takes the
        rows) and is returned at its turn; while it waits or is ``in_flight`` no decision
        starts. ``stale``: the step's slots went stale (a decision from it judges the way
        of such steps and orders no refill; with ``move_bytes``, a re-home where rent or
        buy says, kept for :meth:`take_home`)."""
        if not self.active(cost):
            self.forget(pool, ticket)
            return None
        assert cost is not None
        if self.decisions is None:
            R, E = counts_RE.shape
            res = Residency(R, E, self.B, cost, staging=self.S, device=counts_RE.device)
            self.decisions = Decisions(res, _submit)
        self.decisions.residency.cost = cost  # a calibration may have replaced it
        busy = in_flight or self.waiting is not None
        order = self.decisions.step(counts_RE, plan, busy, stale, move_bytes)
        if order is not None:
            self.orders += 1
            self.waiting = torch.where(order.changed_RB, order.slot_RB, -1)
            pool.join(ticket)
        if self.waiting is None or in_flight or not pool.turn(ticket):
            return None  # (a refill requested by hand may be in flight: it goes first)
        target, self.waiting = self.waiting, None
        pool.leave(ticket)  # the refill takes the rows, if it changes any
        return target

    def take_home(self) -> HomeOffer | None:
        """The re-home offered (``Decisions.take_home``, labels), once; ``None`` if none
        waits (or no decision has run)."""
        return None if self.decisions is None else self.decisions.take_home()

    def forget(self, pool: StagingPool, ticket: object) -> None:
        """Drop the refill waiting for its turn, if any (the slots it was for are gone)."""
        self.waiting = None
        pool.leave(ticket)

    def relabel(
        self,
        pool: StagingPool,
        ticket: object,
        columns_E: torch.Tensor,
        judged: HomeOffer | None = None,
    ) -> None:
        """The layer re-homed: new label ``j`` is old label ``columns_E[j]`` (int64
        ``[E]``). The refill waiting is dropped (its slots are gone) and the decisions
        take the new labels (``Decisions.relabel``: a decision running on the worker is
        waited for and dropped; the window's loads stay, relabelled; the steps serve
        ``judged``'s way, the judgement that chose the order, else planner calls)."""
        self.forget(pool, ticket)
        self._shares = None
        if self.decisions is not None:
            self.decisions.relabel(columns_E.cpu(), judged)

    def close(self) -> None:
        """Wait for this layer's decision on the worker, if one runs."""
        if self.decisions is not None:
            self.decisions.settle()
