"""``LayerRuntime``: one MoE layer's state across steps, built from a ``MoEConfig``.

Legend: R ranks, E experts, M = ceil(E/R), B slots, H hidden, F ffn, S tokens, K top-k,
W refill status words per rank (``moonplan.runtime.refill.STATUS_WORDS``).

Heap, transport, expert store, the resident plan and the step figures
(:class:`~moonplan.runtime.step_stats.StepStats`). Every front end (``MoonMoE``,
``MoonExperts``, torchtitan's ``MoonGroupedExperts``) builds one through
``LayerRuntime(group, cfg)``, collectively.

Everything here is in expert *labels*, rank ``r`` owning the labels of its linear block
(:mod:`moonplan.plan.home`): the counts, plans (``last_plan``), routes, slot tables
(``request_refill``) and home rows. With the config's ``home_order`` label ``i`` is model
expert ``home_order[i]``; :meth:`LayerRuntime.forward` relabels the router's model ids
once, after checking them, and the front ends hold the home rows in label order
(:mod:`moonplan.core.sharded`). Without a home order labels are model ids.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap
from moonplan.plan.home import max_local
from moonplan.plan.home_order import label_of
from moonplan.plan.plan_type import Plan
from moonplan.plan.residency.exact_way import EXACT
from moonplan.plan.residency.serving import LOOKUPS, WEIGHTED, empty_slots, serving_plan
from moonplan.plan.residency.window import LoadWindow
from moonplan.plan.route import Route
from moonplan.plan.route import route as route_tokens
from moonplan.runtime.background import (
    BackgroundLane,
    Pending,
    collectives_in_thread,
    lane_kind,
)
from moonplan.runtime.balancer import Balancer
from moonplan.runtime.buffers import BufferSpec, build_buffers
from moonplan.runtime.calibrate import sample_step, time_local_copy
from moonplan.runtime.config import MoEConfig, Resolved, cost_settings
from moonplan.runtime.contract import check_params, check_routing
from moonplan.runtime.fetch_list import FetchList, HomeRows, fetch_list, plan_rows, row_offsets
from moonplan.runtime.moe_function import MoEStep, moe_apply
from moonplan.runtime.placer import Placer
from moonplan.runtime.refill import Refill, agree, check_target
from moonplan.runtime.step_context import StepContext
from moonplan.runtime.step_hooks import NULL_PROFILER, LayerHooks, StepClock
from moonplan.runtime.step_stats import StepStats
from moonplan.runtime.store import GradReducer
from moonplan.runtime.transports.base import Transport
from moonplan.stepcost import StepCost

Params = Mapping[str, Tensor]
"""Named parameter tensors (``gate_up``, ``down``, ...)."""


class LayerRuntime:
    """Everything one MoE layer needs across steps, besides its parameters.

    Args:
        group: the EP group (every rank of it builds the runtime together).
        cfg: the layer's :class:`~moonplan.runtime.config.MoEConfig`, its sizes set.
        what: the layer's name in the error of a config mismatch (``"<what> config"``).

    Collective: first agrees on every setting that shapes a step
    (:meth:`MoEConfig.resolve`: sizes, the resolved ``B``, ``align``, ``max_tokens``,
    transport and the ranks per host it read from the environment, ``balance``, dtype,
    ``overlap``, the cost model's values), in the first collective every rank enters and
    before any collective allocation: a rank that cannot resolve its config, or settings
    that differ, raise the same error on every rank, naming each differing setting with
    its value per rank. Then allocates (buffers bounded:
    :func:`~moonplan.runtime.buffers.build_buffers`).

    Raises:
        ContractError: on every rank, as above.
        ValueError: on every rank, where every rank failed to resolve ``cfg`` alike
            (e.g. a size that is ``None``, named): that error itself.
    """

    def __init__(self, group: EPGroup, cfg: MoEConfig, *, what: str = "layer"):
        resolved = agree_config(group, cfg, f"{what} config")
        H, F, E, K = cfg.require_sizes()
        B = resolved.slots
        self.group, self.config = group, cfg
        self.E, self.B, self.H, self.F, self.K, self.align = E, B, H, F, K, cfg.buffers.align
        self.dtype, self.kind = cfg.layer_dtype(), cfg.transfer.transport
        self.balance = cfg.balancing.balance
        self.balancer = _balancer(cfg, B)
        self.M = max_local(E, group.size)
        self.label_E = _labels(cfg, group.device)  # model id -> label (None: the identity)
        self.window = LoadWindow(E, device=group.device)  # recent loads, by label
        # balance="auto"'s own re-home (MoEConfig.rehome): the front end's
        # rehome("profile") before a step, judged once; only while no step ran with
        # autograd on (serving)
        self.serving, self.rehome_judged = True, False
        self.heap: SymmetricHeap | None = None
        self.capacity = 0
        self.resident: Plan | None = None  # plan whose slots hold valid weights
        self.last_plan: Plan | None = None
        self.last_stats: StepStats | None = None
        self.published = False
        self.published_version: tuple[int, ...] = ()
        self.plans_made = 0  # planner calls (backward replays the forward plan: none there)
        self.way = "call"  # how the last step's plan was made (Placer.serve)
        self.stale = False  # this step's slots went stale (any rank's weights changed)
        # Phase-timing hooks; moonplan.profile.profiling() installs live ones.
        self.profiler: LayerHooks = NULL_PROFILER
        # Overlapped schedule (prefetch beside dispatch, reduce beside dispatch-backward);
        # False runs the same operations serially (docs/runtime.md).
        self.overlap = cfg.transfer.overlap
        self._lane = BackgroundLane("inline", group.device)
        self._background: EPGroup | None = None  # the worker's collectives (all-to-all)
        self._options = tuple(resolved.transport_options.items())
        self.S = resolved.refill_rows  # refill staging rows per rank (moonplan.runtime.refill)
        self.refill = Refill(group.rank, HomeRows.of(E, group.size))
        self.placer = Placer(self.B, self.S)  # orders refills (balance="auto")
        tokens = cfg.buffers.max_tokens
        sized = f"max_tokens={tokens} x top_k={K}, align={self.align}, slots={B}"
        self._build(self._capacity_for(tokens * K), sized)
        self._background = self._background_group()
        if self._background is not None:
            self.store.fetch_on(self._background)

    def _background_group(self) -> EPGroup | None:
        """The second process group of the worker's all-to-all prefetch and reduce, or
        ``None`` where none is needed: the serial schedule, a one-sided transport (peer
        reads, no collective), a device where :func:`collectives_in_thread` says no
        (CUDA for now: inline), a transport whose ``on_group`` answers ``None`` (said
        loudly; the group taken to ask it is given back at once). The
        single-rank group is its own (it never communicates).

        Taken here, in the collective construction, because every rank reaches this
        point in the same order with the same ``overlap`` and transport (both in the
        config checked above): where ``EPGroup.background_group`` creates the group (the
        first layer on a group spanning the whole world), ``new_group`` then pairs up
        across ranks. Creating it lazily in a step would tie it to the first step that
        starts a background job, which is the same point on every rank too, but would put
        the group's rendezvous inside a step's timing. Every layer on the same
        ``EPGroup`` shares the one group; :meth:`close` releases this layer's hold.

        An EP group of fewer ranks than the world gets one only from the caller
        (``EPGroup(group, background=...)``: see ``EPGroup.background_group`` for why);
        without it the all-to-all prefetch and reduce run inline, and this warns.
        """
        if not self.overlap or self.transport.one_sided:
            return None
        if not collectives_in_thread(self.group.device):
            return None
        background = self.group.background_group()
        if background is None:
            warnings.warn(
                f"transport {self.transport.name!r} on an EP group of {self.group.size} of "
                "the world's ranks: its prefetch and replica-gradient reduce run inline "
                "(serial schedule). To overlap them, pass EPGroup(group, background=pg2), "
                "pg2 a second dist.new_group over the same ranks created on every rank",
                stacklevel=3,
            )
        elif self.transport.on_group(background) is None:  # declared: it cannot
            self.group.release_background()  # every rank alike (the same transport)
            warnings.warn(
                f"transport {self.transport.name!r} cannot move rows on a second process "
                "group (its on_group returns None): its prefetch and replica-gradient "
                "reduce run inline (serial schedule)",
                stacklevel=3,
            )
            return None
        return background

    def _capacity_for(self, records: int) -> int:
        W = self.M + max(self.B, self.M)
        return max(1, records + W * (self.align - 1))

    def _build(self, capacity: int, sized: str) -> None:
        """(Re)create heap, transport and store for ``capacity`` receive rows (collective;
        ``sized``: what asked for them, named if they exceed the bound).

        Transactional (``moonplan.runtime.buffers``): the new set is built while the old
        one still works; if that fails on any rank, every rank raises the same
        ``ContractError`` and keeps its old buffers and ``capacity``.
        """
        spec = BufferSpec(
            self.kind, self.E, self.B, self.M, self.H, self.F, self.dtype, self._options, self.S
        )
        self.refill.drop()  # its staging rows and the home rows it reads are about to go
        new = build_buffers(self.group, spec, capacity, sized=sized)
        old, self.heap, self.capacity = self.heap, new.heap, new.capacity
        self.transport: Transport = new.transport
        self.store, self._reducer = new.store, new.reducer
        if self._background is not None:  # growth: the new store fetches there too
            self.store.fetch_on(self._background)
        if old is not None:
            old.close()
        self.published, self.resident = False, None

    def lane(self) -> BackgroundLane:
        """Where this step's prefetch and reduce run (a worker thread, a side stream, or
        inline: see :mod:`moonplan.runtime.background`)."""
        kind = lane_kind(
            self.transport.one_sided,
            self.group.device,
            self.overlap,
            second_group=self._background is not None,
        )
        if self._lane.kind != kind:
            self._lane.close()
            self._lane = BackgroundLane(kind, self.group.device)
        return self._lane

    def close(self) -> None:
        """Join the background lane's worker, wait for this layer's decision on the
        process's decision worker (which every layer shares and which ends with the
        process), leave the staging rows' line, release the heap and the background process
        group (collective: every rank). Without ``close()`` the lane's worker ends with the
        process, the background group lives until ``dist.destroy_process_group()``, and the
        layer leaves the line only when it is collected (moonplan.runtime.staging)."""
        self.refill.drop()
        self.placer.forget(self.store.pool, self.refill)
        self.placer.close()
        self._lane.close()
        if self._background is not None:
            self.group.release_background()
            self._background = None
            self.store.fetch_on(self.group)
        if self.heap is not None:
            self.heap.close()
            self.heap = None

    def reducer(self) -> GradReducer:
        """Where replica gradients go home (allocated with the store)."""
        return self._reducer

    def context(self) -> StepContext:
        """What this step runs on (:class:`StepContext`): the transport, store, reducer
        and lane of now, this rank, ``M`` and ``B``."""
        return StepContext(
            self.transport, self.store, self._reducer, self.lane(), self.group.rank, self.M, self.B
        )

    def calibrate(self) -> StepCost:
        """Collective: a :class:`StepCost` from this layer's measured steps, agreed across
        ranks (element-wise max, then checked like the config: every value the same on
        every rank, or the same ``ContractError`` everywhere); ``balance="auto"`` plans
        with it from the next step."""
        self._lane.drain()
        home = {name: self.store.local[name][: self.M] for name in self.store.local}
        cost = self.balancer.calibrate(
            self.group,
            copy_fallback_s=time_local_copy(home),
            overlap=self.lane().kind != "inline",
        )
        self.group.check_settings("calibrated cost", cost_settings(cost))
        return cost

    def set_cost(self, cost: StepCost) -> None:
        """Collective: plan ``balance="auto"`` with ``cost`` from the next step on (as
        ``MoEConfig.cost`` would have: no calibration). Agreed like the config: a
        ``cost`` that is not a :class:`StepCost` on some rank (``TypeError`` where on
        every rank), or values that differ, raise the same error on every rank and
        change nothing.
        """
        if not isinstance(cost, StepCost):
            bad = TypeError(f"cost must be a moonplan.stepcost.StepCost, got {cost!r}")
            self.group.fail_settings("cost", bad)
        self.group.check_settings("cost", cost_settings(cost))
        self._lane.drain()
        self.config = self.config.replace(cost=cost)
        self.balancer = _balancer(self.config, self.B)

    def rehome(self, cfg: MoEConfig, move: Callable[[], None]) -> None:
        """Take ``cfg``'s home order, the front end's ``move`` (collective) carrying the
        home rows there (:meth:`ShardedExperts.rehome
        <moonplan.core.sharded.ShardedExperts.rehome>`).

        First the background lane drains (a replica-gradient reduce may still write
        gradients) and any refill is dropped. Then ``move`` runs and the layer takes the
        new labels: slots, the placer's window and decisions start afresh (they are in
        the old labels), the weights republish before the next step, ``last_plan`` is
        ``None``.
        """
        self._lane.drain()
        self.refill.drop()
        self.placer.reset(self.store.pool, self.refill)
        move()
        old_E = self.label_E
        self.config, self.label_E = cfg, _labels(cfg, self.group.device)
        new = cfg.sizes.home_order or range(self.E)  # model expert of each new label
        columns_E = torch.tensor(list(new), dtype=torch.int64, device=self.group.device)
        self.window.relabel(columns_E if old_E is None else old_E[columns_E])
        self.weights_changed()
        self.last_plan = None

    def recent_loads(self) -> Tensor:
        """int64 ``[E]``: records per *model* expert over the last ``WINDOW`` steps (all
        ranks; the same on every rank), a profile for
        :func:`~moonplan.plan.home_order.popular_order`."""
        totals_E = self.window.totals_E()  # by label
        return totals_E if self.label_E is None else totals_E[self.label_E]

    def request_refill(self, target_RB: Tensor) -> None:
        """Collective: refill the resident slots with ``target_RB`` (int64 ``[R, B]`` expert
        labels, ``-1``: keep) beside the next steps; call it on every rank alike, between
        steps.

        The changed slots (``target[r][j] >= 0`` and not what the last plan holds there,
        at most ``S = refill_rows`` per rank) are copied from their experts' home rows into
        staging rows by a job on the background lane; the steps keep serving the old
        slots until every rank's copy is done, and the first step that sees that in its
        counts exchange puts them into the slots before it plans
        (:mod:`moonplan.runtime.refill`; docs/runtime.md, "Refilling slots in the
        background"). A failed copy on any rank, changed weights or a resync drop it on
        every rank. Nothing to change starts nothing. Two small all-gathers check the
        request (valid everywhere, the same target everywhere).

        Raises:
            ValueError: on every rank: ``target`` is not an integer ``[R, B]`` tensor of a
                valid slot table (a ``PlanError``), or changes more than ``S`` slots on a
                rank (each named).
            RuntimeError: on every rank: a refill is already in flight
                (:attr:`Refill.in_flight`; wait for its commit or drop), another layer's
                refill holds the shared staging rows (:mod:`moonplan.runtime.staging`), or
                the home
                weights are not published (no step since the layer was built or since
                :meth:`weights_changed`).
            ContractError: the ranks disagree (one rank's request is bad, or the targets
                differ), naming them.
        """
        R = self.group.size
        current = self.resident.slot_expert if self.resident is not None else None
        if current is None:
            current = empty_slots(R, self.B)
        try:
            changed = check_target(target_RB, current, num_experts=self.E, staging_rows=self.S)
            if self.refill.in_flight:
                raise RuntimeError("a refill is already in flight: wait for its commit or drop")
            if self.store.pool.held_by_other(self.refill):
                raise RuntimeError(
                    "another layer's refill holds the shared staging rows "
                    "(moonplan.runtime.staging): wait for its commit or drop"
                )
            if not self.published:
                raise RuntimeError("no published home weights to refill from: run a step first")
            err: Exception | None = None
        except (ValueError, RuntimeError) as exc:
            err = exc
        self.group.outcome("request_refill", err)
        target = target_RB.to("cpu", torch.int64)
        self.group.check_same("refill target", tuple(target.flatten().tolist()))
        collective = not self.store.transport.one_sided
        self.refill.start(
            target, changed, self.store.stage, self.lane(), pool=self.store.pool,
            collective=collective,
        )  # fmt: skip

    def weights_changed(self) -> None:
        """Home weights changed: republish them before the next step; every slot is stale.

        In-place updates of the expert parameters (optimizer steps, ``copy_``) are
        detected by their version counters and shared with every rank in the counts
        exchange, so calling this is only needed after changes torch cannot see.
        """
        self.published, self.resident = False, None
        self.published_version = ()

    def forward(
        self,
        x_SH: torch.Tensor,
        ids_SK: torch.Tensor | None,
        weight_SK: torch.Tensor,
        params: dict[str, torch.Tensor],
        ok: bool = True,
        msg: str = "",
        *,
        own: Params | None = None,
    ) -> torch.Tensor:
        """One step: ``x [S, H]``, routing ``ids [S, K]``, ``weight [S, K]`` -> ``y [S, H]``.

        Every rank calls it (also with zero tokens). ``params`` holds ``gate_up
        [E_r, 2F, H]`` and ``down [E_r, H, F]`` in the runtime's dtype (and any tensor
        whose version counter tells that the weights changed); ``own``: the parameters
        that must still be in that dtype on the group's device (default ``params``).
        ``ok=False`` (with ``msg``) reports a failure seen before the step: every rank
        then raises ``ContractError`` naming this rank and ``msg``; so do bad parameters
        or routing (``moonplan.runtime.contract``). ``ids`` are model ids: checked, then
        relabelled (``label_E[ids]``, with a home order) before anything counts them;
        ``params`` hold the home rows in label order.

        Four stages: exchange the counts, plan, execute (prefetch, dispatch, experts,
        combine), record the step's figures.
        """
        x_SH, ids_SK, weight_SK, ok, msg = self._contribution(
            x_SH, ids_SK, weight_SK, params if own is None else own, ok, msg
        )
        if ids_SK is not None and self.label_E is not None:  # ids checked in [0, E) above
            ids_SK = self.label_E[ids_SK]  # model ids -> labels: all the step sees
        self._lane.drain()  # a failed step's background job, before buffers change
        clock = StepClock(self.profiler.begin_step())  # records nothing unless profiling
        t = time.perf_counter()
        counts_RE, version, refill_RW = self._exchange_counts(ids_SK, params, ok, msg)
        self.window.observe(counts_RE)
        self._settle_refill(counts_RE, refill_RW)
        t = clock.tick("counts", t)
        if self.balancer.due():  # "auto" after its measured warm-up steps (every rank
            self.calibrate()  # alike: decided after the schedules are compared)
            t = time.perf_counter()
        plan, copies, offsets = self._plan_step(counts_RE)
        step = MoEStep(self.context(), plan, offsets, self._route(plan, ids_SK), clock)
        self._publish_home(params, version)
        y_SH, fetched = self._execute(step, copies, t, x_SH, weight_SK, params)
        self._record(step, copies, fetched)
        self._place(counts_RE, plan)
        return y_SH

    def rehome_due(self) -> bool:
        """Whether this step begins with ``balance="auto"``'s own re-home
        (``MoEConfig.rehome``): once, at the first step after the window of loads first
        fills, with a cost model, where every step so far ran with autograd off on every
        rank (serving: no optimizer state to leave behind). The front end asks before it
        reads its parameters (:meth:`ShardedExperts.step_begins
        <moonplan.core.sharded.ShardedExperts.step_begins>`). Every input is agreed, so
        every rank answers alike."""
        return (
            self.config.balancing.rehome
            and self.serving
            and not self.rehome_judged
            and self.window.filled == self.window.W
            and self.auto_cost() is not None
        )

    def auto_cost(self) -> StepCost | None:
        """The cost model ``auto`` plans with (``None`` before calibration or in another
        mode)."""
        return self.balancer.cost if self.balancer.policy() == "auto" else None

    def _place(self, counts_RE: Tensor, plan: Plan) -> None:
        """Hand the step to the placer; request the refill it orders once the shared
        staging rows are its turn (every rank alike: :mod:`moonplan.runtime.placer`). Not
        while the slots are stale (weights changed): a refill waiting then is dropped."""
        pool = self.store.pool
        if self.resident is None:
            self.placer.forget(pool, self.refill)  # its slots are stale: no refill for them
            return
        target = self.placer.after_step(
            counts_RE, plan, self.auto_cost(), self.refill.in_flight, pool, self.refill,
            stale=self.stale,
        )  # fmt: skip
        if target is not None:
            self.request_refill(target)

    def _exchange_counts(
        self, ids_SK: Tensor | None, params: Params, ok: bool, msg: str
    ) -> tuple[Tensor, tuple[int, ...], np.ndarray]:
        """Collective: every rank's counts ``[R, E]``, this rank's weight versions and
        every rank's refill status (int64 numpy ``[R, W]``).

        One exchange carries the counts, the validity flag (a rank that is not ``ok``
        makes every rank raise), "my home weights changed" (then every slot is stale),
        where this rank is in the step schedule (:meth:`Balancer.schedule`; where ranks
        differ the resident slots are dropped), "autograd is on for my parameters" (after
        one such step on any rank the layer never re-homes by itself) and its refill status
        (:meth:`Refill.status_words`; either event above drops the refill in flight). One
        host read, of the flags.
        """
        counts_E = torch.zeros(self.E, dtype=torch.int64, device=self.group.device)
        if ok and ids_SK is not None and ids_SK.numel():
            counts_E = torch.bincount(ids_SK.reshape(-1), minlength=self.E)
        version = tuple(int(p._version) for p in params.values())
        changed = int(version != self.published_version)
        graded = torch.is_grad_enabled() and any(p.requires_grad for p in params.values())
        mine = counts_E.new_tensor([changed, self.balancer.schedule(), int(graded)])
        refill_W = self.refill.status_words(counts_E.device)
        got_RX = self.group.gather_with_status(torch.cat([counts_E, mine, refill_W]), ok, msg)
        counts_RE, flags_RX = got_RX[:, : self.E], got_RX[:, self.E :].cpu()  # one host read
        stale = self.stale = bool(flags_RX[:, 0].any())  # any rank's weights changed
        if stale:
            self.published, self.resident = False, None
        self.serving = self.serving and not bool(flags_RX[:, 2].numpy().any())  # autograd on
        if self.balancer.resync(flags_RX[:, 1]) or stale:  # resync: a step failed somewhere
            self.resident = None
            self.refill.drop()  # its copies are stale (or the ranks are out of step)
            flags_RX[:, 3] = 0  # nothing left to agree on (every rank alike)
        return counts_RE, version, flags_RX[:, 3:].numpy()  # already on the host

    def _settle_refill(self, counts_RE: Tensor, status_RW: np.ndarray) -> None:
        """Commit or drop the refill in flight from every rank's status (``[R, W]``), the
        same decision on every rank (:func:`~moonplan.runtime.refill.agree`). Commit: the
        staging rows go into the slots now, between steps (the previous step's backward
        is done with its slots, and its background jobs are drained), and the step plans
        with ``previous`` = the serving plan of the refilled slots
        (:func:`~moonplan.plan.residency.serving.serving_plan`)."""
        decision, why = agree(status_RW)
        if decision == "commit":
            R = self.group.size
            current = self.resident.slot_expert if self.resident is not None else None
            if current is None:
                current = empty_slots(R, self.B)
            slots_RB = self.refill.commit(self.store.commit, current)
            self.resident = serving_plan(counts_RE, slots_RB, align=self.align)
            self.placer.arrived(slots_RB)
        elif decision == "drop":
            self.refill.drop()
            warnings.warn(
                f"refill dropped on every rank, the old slots keep serving: {why}",
                RuntimeWarning,
                stacklevel=3,
            )

    def _plan_step(self, counts_RE: Tensor) -> tuple[Plan, FetchList, tuple[int, ...]]:
        """The step's plan (one planner call), this rank's weight copies under it and its
        row offsets (``plan.row_offset[rank]``, ``W + 1`` host integers).

        Reading the plan's rows is one host read (every policy pays it, static too):
        receive rows, copies and row offsets at once (:func:`plan_rows`); where a rank
        needs more rows than the buffers hold, every rank sees the same plan and all
        grow together, then plan again without residents.
        """
        plan = self._one_plan(counts_RE, self.resident)
        self.plans_made += 1
        rows = plan_rows(plan)
        need = int(rows[:, -1].max())
        while need > self.capacity:
            self._build(self._capacity_for(need), f"this step's plan needs {need} rows")
            plan = self._one_plan(counts_RE, None)  # new buffers: no residents
            rows = plan_rows(plan)
            need = int(rows[:, -1].max())
        rank = self.group.rank
        return plan, fetch_list(plan, rank, self.store.home, rows), row_offsets(plan, rank, rows)

    def _one_plan(self, counts_RE: Tensor, previous: Plan | None) -> Plan:
        """One planner call, or the way the placer says is faster over its window (a
        lookup of the slots, or the exact kernel: :meth:`~moonplan.runtime.placer.Placer
        .serve`), judged for steps like this one: whose slots stay, or go stale (weights
        changed, as at every training step), as the simulator's ``moonplan-auto``."""
        how = self.way = self.placer.serve(self.stale)
        if how != "call":
            shares = self.placer.shares(self.stale, counts_RE.device)
            return self.balancer.serve(counts_RE, previous, how, shares)
        rent = not self.placer.active(self.auto_cost())
        return self.balancer.plan(counts_RE, previous, rent)

    def _route(self, plan: Plan, ids_SK: Tensor | None) -> Route:
        """This rank's records under ``plan``. Affinity (a token's records on few ranks)
        pays only where dispatch sends token rows (docs/design.md §3); per-record
        transports skip computing it."""
        ids = ids_SK if ids_SK is not None else torch.zeros(0, self.K, dtype=torch.int64)
        tokens = self.transport.rows == "tokens"
        return route_tokens(plan, self.group.rank, ids, check=False, affinity=tokens)

    def _publish_home(self, params: Params, version: tuple[int, ...]) -> None:
        """Collective where any rank's weights changed: copy the home experts into the
        store's shared rows, visible to every rank before its prefetch reads them."""
        if not self.published:
            self.store.publish_home(params)
            self.published, self.published_version = True, version

    def _execute(
        self,
        step: MoEStep,
        copies: FetchList,
        t_plan: float,
        x_SH: Tensor,
        weight_SK: Tensor,
        params: Params,
    ) -> tuple[Tensor, int]:
        """Start the prefetch, run the step (dispatch, experts, combine); ``(y [S, H],
        slot rows fetched)``. Planning, timed from ``t_plan``, ends where the prefetch
        starts; with nothing to copy (no job) nothing of it is exposed."""
        t2 = time.perf_counter()
        step.fetch = self._start_prefetch(copies)
        t3 = t2 if step.fetch is None else time.perf_counter()
        step.clock.span("plan", t_plan, t2)
        step.clock.span("prefetch_exposed", t2, t3)
        y_SH = moe_apply(step, x_SH, weight_SK, params["gate_up"], params["down"])
        fetched = 0 if step.fetch is None else step.fetch.wait()[0]
        return y_SH, fetched

    def _record(self, step: MoEStep, copies: FetchList, fetched: int) -> None:
        """Keep the step's plan (its slots now hold valid weights) and figures
        (:attr:`last_stats`, whose ``phases`` the step's backward extends), hand the
        traffic to the profiler and the measurements to the balancer."""
        plan = step.plan
        self.resident = plan if self.B > 0 else None
        self.last_plan = plan
        s = plan.summary()
        self.last_stats = StepStats(
            s["copies"],
            s["new_copies"],
            fetched,
            s["static_max_over_mean"],
            s["planned_max_over_mean"],
            step.clock.phases,
            **self._plan_figures(plan, copies),
            records=step.traffic.get("records", 0),
            rows_sent=step.traffic.get("rows_sent", 0),
            bytes_sent=step.traffic.get("bytes_sent", 0),
            heap=self.heap.backend if self.heap is not None else "",
        )
        step.clock.hooks.traffic(self.last_stats.records, self.last_stats.rows_sent)
        sent = step.route.dest_rank.numel()
        got = len(copies.slot_N) + len(copies.direct_rank_D)  # expert weights fetched
        rank, phases = self.group.rank, step.clock.phases
        self.balancer.record(functools.partial(
            sample_step, plan, rank, sent, phases, bounds_W1=step.row_offset, fetched=got
        ))  # fmt: skip

    def _contribution(
        self, x_SH: Tensor, ids_SK: Any, weight_SK: Any, own: Params, ok: bool, msg: str
    ) -> tuple[Tensor, Tensor | None, Tensor, bool, str]:
        """``(x, ids, weight, ok, msg)`` after the local checks; empty placeholders where
        this rank is not ``ok``."""
        K, dev = self.K, self.group.device
        if ok:
            msg = check_params(own, self.dtype, dev) or check_routing(
                ids_SK, weight_SK, x_SH.shape[0], self.E, K, dev
            )
            ok = not msg
        if not ok or ids_SK is None:
            x_SH = torch.zeros(0, x_SH.shape[-1], dtype=self.dtype, device=dev)
            return x_SH, None, torch.zeros(0, K, device=dev), False, msg
        return x_SH, ids_SK.long(), weight_SK, ok, msg

    def _start_prefetch(self, fetch: FetchList) -> Pending | None:
        """Start filling new slots and reading direct rows (the step's ``Pending``).

        ``fetch`` is this rank's copies, read from the plan while planning
        (:func:`~moonplan.runtime.fetch_list.fetch_list`). ``None`` (no job) when there
        is nothing to copy: static and resident-only plans, and on a collective
        transport only when no rank copies anything. Home rows were published behind
        a barrier, and this rank's previous step (backward included) is done with its
        slots, so the copies need no collective on the heap and run beside the
        dispatch; on the all-to-all path they are collectives, started (or not) on
        every rank alike, in the worker on the background group, or inline (see
        :mod:`moonplan.runtime.background`).
        """
        store = self.store
        if not (fetch.mine if store.transport.one_sided else fetch.group):
            return None
        return self.lane().submit(lambda: store.prefetch(fetch))

    def _plan_figures(self, plan: Plan, copies: FetchList) -> dict[str, Any]:
        """``direct_reads``, ``policy``, ``predicted`` and ``choice`` of a plan for
        :class:`StepStats` (``copies``: this rank's copies under it, already on the host)."""
        return {
            "direct_reads": len(copies.direct_rank_D),
            "policy": plan.policy,
            "predicted": dict(plan.predicted),
            "choice": _how(plan, self.way),
        }


def _how(plan: Plan, way: str) -> str:
    """``StepStats.choice``: ``"full"`` (``auto`` scored every candidate), ``"exit"`` (its
    early exit), ``"lookup"`` (``auto`` served a lookup of the slots without a call),
    ``"exact"`` (``auto`` served the exact kernel, ``way`` ``"exact"``: ``Placer.serve``)
    or ``"none"`` (``balance="exact"``, ``"off"`` and ``auto``'s warm-up)."""
    if way == EXACT:
        return EXACT
    if plan.choice is None:
        return "lookup" if plan.requested in (*LOOKUPS, WEIGHTED) else "none"
    return "exit" if plan.choice.early_exit() else "full"


def agree_config(group: EPGroup, cfg: MoEConfig, what: str) -> Resolved:
    """Collective: ``cfg`` resolved on this group (:meth:`MoEConfig.resolve`), the same on
    every rank; else the same error on every rank: the ranks that could not resolve it
    (and why), or each setting that differs with its value per rank
    (:meth:`EPGroup.check_settings`, :meth:`EPGroup.fail_settings`)."""
    try:
        resolved = cfg.resolve(group.size)
    except Exception as exc:  # reported to every rank, not raised here alone
        group.fail_settings(what, exc)
    group.check_settings(what, resolved.agreed)
    return resolved


def _labels(cfg: MoEConfig, device: torch.device) -> Tensor | None:
    """``label_E``: int64 ``[E]`` on ``device``, the label of each model expert under the
    config's ``home_order`` (:func:`~moonplan.plan.home_order.label_of`); ``None``
    without one (labels are model ids)."""
    order = cfg.sizes.home_order
    if order is None:
        return None
    return torch.tensor(label_of(list(order)), dtype=torch.int64, device=device)


def _balancer(cfg: MoEConfig, slots: int) -> Balancer:
    """The :class:`Balancer` of a layer of ``cfg`` with ``slots`` slots."""
    b = cfg.balancing
    return Balancer(b.balance, slots=slots, align=cfg.buffers.align, cost=b.cost)
