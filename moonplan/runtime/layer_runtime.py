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

This file is the layer's construction and its step (:meth:`LayerRuntime.forward` and its
stages, in the order they run). Its bases hold the rest: what the steps run on
(:class:`~moonplan.runtime.layer_resources.LayerResources`: buffers, background group,
lane, ``close``) and what runs between steps
(:class:`~moonplan.runtime.between_steps.BetweenSteps`: ``calibrate``, ``set_cost``,
``rehome``, ``request_refill``, ``weights_changed``); what construction derives from the
config is :mod:`moonplan.runtime.layer_setup`.
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
from moonplan.plan.home import max_local
from moonplan.plan.plan_type import Plan
from moonplan.plan.residency.exact_way import EXACT
from moonplan.plan.residency.serving import LOOKUPS, WEIGHTED, empty_slots, serving_plan
from moonplan.plan.residency.window import LoadWindow
from moonplan.plan.route import Route
from moonplan.plan.route import route as route_tokens
from moonplan.runtime.background import BackgroundLane, Pending
from moonplan.runtime.between_steps import BetweenSteps, agreed_move_bytes, move_word
from moonplan.runtime.calibrate import sample_step
from moonplan.runtime.config import MoEConfig
from moonplan.runtime.contract import check_params, check_routing
from moonplan.runtime.fetch_list import FetchList, HomeRows, fetch_list, plan_rows, row_offsets
from moonplan.runtime.layer_setup import agree_config, home_labels, layer_balancer
from moonplan.runtime.moe_function import MoEStep, moe_apply
from moonplan.runtime.outside_inference import outside_inference
from moonplan.runtime.placer import Placer
from moonplan.runtime.refill import Refill, agree
from moonplan.runtime.step_hooks import NULL_PROFILER, LayerHooks, StepClock
from moonplan.runtime.step_stats import StepStats

Params = Mapping[str, Tensor]
"""Named parameter tensors (``gate_up``, ``down``, ...)."""


class LayerRuntime(BetweenSteps):
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

    @outside_inference()  # what it builds outlives the caller's mode
    def __init__(self, group: EPGroup, cfg: MoEConfig, *, what: str = "layer"):
        resolved = agree_config(group, cfg, f"{what} config")
        H, F, E, K = cfg.require_sizes()
        B = resolved.slots
        self.group, self.config = group, cfg
        self.E, self.B, self.H, self.F, self.K, self.align = E, B, H, F, K, cfg.buffers.align
        self.dtype, self.kind = cfg.layer_dtype(), cfg.transfer.transport
        self.balance = cfg.balancing.balance
        self.balancer = layer_balancer(cfg, B)
        self.M = max_local(E, group.size)
        self.label_E = home_labels(cfg, group.device)  # model id -> label (None: the identity)
        self.window = LoadWindow(E, device=group.device)  # recent loads, by label
        # balance="auto"'s own re-home (MoEConfig.rehome): serving (no step ran with
        # autograd on), the front end's rehome("profile") before a step, judged once; in
        # training, the placer's offers (rent or buy), taken at the start of a step, with
        # the state of the optimizer that last stepped the experts
        # (moonplan.core.optimizer_rehome), which sets own_move_bytes
        self.serving, self.rehome_judged = True, False
        self.own_move_bytes, self.move_bytes = 0.0, 0.0
        self.heap = None
        self.capacity = 0
        self.resident = None  # plan whose slots hold valid weights
        self.last_plan = None
        self.plan_listeners: list[Callable[[Plan], None]] = []  # told each step's plan
        self.last_stats: StepStats | None = None
        self.published = False
        self.published_version = ()
        self.plans_made = 0  # planner calls (backward replays the forward plan: none there)
        self.way = "call"  # how the last step's plan was made (Placer.serve)
        self.stale = False  # this step's slots went stale (any rank's weights changed)
        # Phase-timing hooks; moonplan.profile.profiling() installs live ones.
        self.profiler: LayerHooks = NULL_PROFILER
        # Overlapped schedule (prefetch beside dispatch, reduce beside dispatch-backward);
        # False runs the same operations serially (docs/runtime.md).
        self.overlap = cfg.transfer.overlap
        self._lane = BackgroundLane("inline", group.device)
        self._background = None  # the worker's collectives (all-to-all)
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

    @outside_inference()  # what the step keeps serves later steps in any mode
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

    def _exchange_counts(
        self, ids_SK: Tensor | None, params: Params, ok: bool, msg: str
    ) -> tuple[Tensor, tuple[int, ...], np.ndarray]:
        """Collective: every rank's counts ``[R, E]``, this rank's weight versions and
        every rank's refill status (int64 numpy ``[R, W]``).

        One exchange carries the counts, the validity flag (a rank that is not ``ok``
        makes every rank raise), "my home weights changed" (then every slot is stale),
        where this rank is in the step schedule (:meth:`Balancer.schedule`; where ranks
        differ the resident slots are dropped), "autograd is on for my parameters" (after
        one such step on any rank the layer no longer re-homes at a step's start: in training
        its decisions offer re-homes), what a re-home would move per byte of weights here
        (``own_move_bytes``, agreed into ``move_bytes``: ``between_steps.agreed_move_bytes``)
        and its refill status
        (:meth:`Refill.status_words`; either event above drops the refill in flight). One
        host read, of the flags.

        Raises:
            ContractError: on every rank, where ranks would move different bytes per byte
                of weights (their optimizers differ).
        """
        counts_E = torch.zeros(self.E, dtype=torch.int64, device=self.group.device)
        if ok and ids_SK is not None and ids_SK.numel():
            counts_E = torch.bincount(ids_SK.reshape(-1), minlength=self.E)
        version = tuple(int(p._version) for p in params.values())
        changed = int(version != self.published_version)
        graded = torch.is_grad_enabled() and any(p.requires_grad for p in params.values())
        move = move_word(self.own_move_bytes)
        mine = counts_E.new_tensor([changed, self.balancer.schedule(), int(graded), move])
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
            flags_RX[:, 4] = 0  # nothing left to agree on (every rank alike)
        self.move_bytes = agreed_move_bytes(flags_RX[:, 3].numpy().tolist())  # raises everywhere
        return counts_RE, version, flags_RX[:, 4:].numpy()  # already on the host

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

    def _record(self, step: MoEStep, copies: FetchList, fetched: int) -> None:
        """Keep the step's plan (its slots now hold valid weights) and figures
        (:attr:`last_stats`, whose ``phases`` the step's backward extends), hand the
        traffic to the profiler and the measurements to the balancer."""
        plan = step.plan
        self.resident = plan if self.B > 0 else None
        self.last_plan = plan
        for listen in self.plan_listeners:  # e.g. a TraceRecorder
            listen(plan)
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

    def _plan_figures(self, plan: Plan, copies: FetchList) -> dict[str, Any]:
        """``direct_reads``, ``policy``, ``predicted`` and ``choice`` of a plan for
        :class:`StepStats` (``copies``: this rank's copies under it, already on the host)."""
        return {
            "direct_reads": len(copies.direct_rank_D),
            "policy": plan.policy,
            "predicted": dict(plan.predicted),
            "choice": _how(plan, self.way),
        }

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
            stale=self.stale, move_bytes=self.move_bytes,  # 0 unless an optimizer set it
        )  # fmt: skip
        if target is not None:
            self.request_refill(target)


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
