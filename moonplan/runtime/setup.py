"""Per-layer runtime state: heap, transport, expert store, the resident plan, step figures.

Legend: R ranks, E experts, M = ceil(E/R), B slots, H hidden, F ffn, S tokens, K top-k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap
from moonplan.plan.home import home_start
from moonplan.plan.plan_type import Plan
from moonplan.plan.route import route as route_tokens
from moonplan.profiling.hooks import NULL_PROFILER, LayerProfiler, NullProfiler
from moonplan.runtime.background import BackgroundLane, Pending, lane_kind
from moonplan.runtime.balancer import Balancer
from moonplan.runtime.buffers import BufferSpec, build_buffers
from moonplan.runtime.calibrate import time_local_copy
from moonplan.runtime.moe_function import MoEStep, moe_apply
from moonplan.runtime.store import GradReducer
from moonplan.runtime.transports import registry as transports
from moonplan.runtime.transports.base import Transport
from moonplan.stepcost import StepCost


@dataclass
class StepStats:
    """Figures of one step (host values; phase times in seconds).

    ``phases`` has ``counts``, ``plan``, ``dispatch``, ``experts``, ``combine`` and
    ``prefetch_exposed`` (time the step waited for the weight prefetch: submitting it,
    and the experts waiting for it) on the critical path, and ``prefetch`` (the
    prefetch's own duration, measured where it runs: in the background with an
    overlapped schedule) after the forward; it gains ``combine_backward``,
    ``experts_backward``, ``dispatch_backward``, ``grad_reduce_exposed`` and
    ``grad_reduce`` (the same pair for the replica-gradient reduce) once the step's
    backward has run.

    ``direct_reads``: replicas whose weights this rank read from their home rank this
    step (beyond its slots); ``policy``: the balance policy of the step's plan;
    ``predicted``: the cost model's predicted step seconds per candidate policy
    (empty when the step was not planned with a cost model).

    ``records``: this rank's ``(token, k)`` records; ``rows_sent``: rows its dispatch
    sent (one per record, or one per ``(token, destination rank)`` on a token-row
    transport; its own rank included); ``bytes_sent``: bytes it sent in dispatch and
    combine (rows, per-record words, rows returned as executing rank); the backward
    moves the same the other way (``moonplan.runtime.transports.base.StepState``).
    """

    copies: int = 0
    new_copies: int = 0
    prefetched_rows: int = 0
    static_max_over_mean: float = 1.0
    planned_max_over_mean: float = 1.0
    phases: dict[str, float] = field(default_factory=dict)
    direct_reads: int = 0
    policy: str = "exact"
    predicted: dict[str, float] = field(default_factory=dict)
    records: int = 0
    rows_sent: int = 0
    bytes_sent: int = 0

    @property
    def rows_per_record(self) -> float:
        """``rows_sent / records`` (1.0 with no records)."""
        return self.rows_sent / self.records if self.records else 1.0


def register_home(module: nn.Module, group: EPGroup, num_experts: int) -> tuple[int, int]:
    """This rank's home experts ``(lo, hi)`` (global ids ``lo .. hi-1``) of ``num_experts``.

    Registers them on ``module`` as the non-persistent int64 buffer
    ``home_experts [E_r]`` on the group's device.
    """
    R, r = group.size, group.rank
    lo, hi = home_start(r, num_experts, R), home_start(r + 1, num_experts, R)
    module.register_buffer(
        "home_experts", torch.arange(lo, hi, device=group.device), persistent=False
    )
    return lo, hi


def make_runtime(
    group: EPGroup,
    *,
    num_experts: int,
    slots: int,
    hidden: int,
    ffn: int,
    top_k: int,
    align: int,
    dtype: torch.dtype,
    max_tokens: int,
    transport: str,
    balance: str,
    what: str,
    cost: StepCost | None = None,
) -> LayerRuntime:
    """Check the layer's config is the same on every rank, then build its :class:`LayerRuntime`.

    Collective. ``what`` names the layer in the error (``"<what> config"``); the check runs
    before any collective allocation, so a mismatch raises the same ``ContractError``
    on every rank instead of leaving them waiting.
    """
    group.check_same(f"{what} config", (hidden, ffn, num_experts, top_k, slots, align))
    return LayerRuntime(
        group,
        num_experts=num_experts,
        slots=slots,
        hidden=hidden,
        ffn=ffn,
        top_k=top_k,
        align=align,
        dtype=dtype,
        max_tokens=max_tokens,
        transport=transport,
        balance=balance,
        cost=cost,
    )


class LayerRuntime:
    """Everything one MoE layer needs across steps, besides its parameters."""

    def __init__(
        self,
        group: EPGroup,
        *,
        num_experts: int,
        slots: int,
        hidden: int,
        ffn: int,
        top_k: int,
        align: int,
        dtype: torch.dtype,
        max_tokens: int,
        transport: str,
        balance: str = "exact",
        cost: StepCost | None = None,
    ):
        if transport != "auto":
            transports.check(transport)  # the registered names, listed if unknown
        self.group = group
        self.E, self.B, self.H, self.F, self.K, self.align = (
            num_experts,
            slots,
            hidden,
            ffn,
            top_k,
            align,
        )
        self.dtype, self.kind, self.balance = dtype, transport, balance
        self.balancer = Balancer(balance, slots=slots, align=align, cost=cost)
        self.M = -(-num_experts // group.size)
        self.heap: SymmetricHeap | None = None
        self.capacity = 0
        self.resident: Plan | None = None  # plan whose slots hold valid weights
        self.last_plan: Plan | None = None
        self.last_stats: StepStats | None = None
        self.published = False
        self.published_version: tuple[int, ...] = ()
        self.plans_made = 0  # planner calls (backward replays the forward plan: none there)
        # Phase-timing hooks; moonplan.profile.profiling() installs live ones.
        self.profiler: LayerProfiler | NullProfiler = NULL_PROFILER
        # Overlapped schedule (prefetch beside dispatch, reduce beside dispatch-backward);
        # False runs the same operations serially (docs/runtime.md).
        self.overlap = True
        self._lane = BackgroundLane("inline", group.device)
        self._build(self._capacity_for(max_tokens * top_k))

    def _capacity_for(self, records: int) -> int:
        W = self.M + max(self.B, self.M)
        return max(1, records + W * (self.align - 1))

    def _build(self, capacity: int) -> None:
        """(Re)create heap, transport and store for ``capacity`` receive rows (collective).

        Transactional (``moonplan.runtime.buffers``): the new set is built while the old
        one still works; if that fails on any rank, every rank raises the same
        ``ContractError`` and keeps its old buffers and ``capacity``.
        """
        spec = BufferSpec(self.kind, self.E, self.B, self.M, self.H, self.F, self.dtype)
        new = build_buffers(self.group, spec, capacity)
        old, self.heap, self.capacity = self.heap, new.heap, new.capacity
        self.transport: Transport = new.transport
        self.store, self._reducer = new.store, new.reducer
        if old is not None:
            old.close()
        self.published, self.resident = False, None

    def lane(self) -> BackgroundLane:
        """Where this step's prefetch and reduce run (a worker thread, a side stream, or
        inline: see :mod:`moonplan.runtime.background`)."""
        kind = lane_kind(self.transport.one_sided, self.group.device, self.overlap)
        if self._lane.kind != kind:
            self._lane.close()
            self._lane = BackgroundLane(kind, self.group.device)
        return self._lane

    def close(self) -> None:
        """Join the background worker and release the heap (collective: every rank)."""
        self._lane.close()
        if self.heap is not None:
            self.heap.close()
            self.heap = None

    def reducer(self) -> GradReducer:
        """Where replica gradients go home (allocated with the store)."""
        return self._reducer

    def _plan(self, counts_RE: torch.Tensor, previous: Plan | None) -> Plan:
        return self.balancer.plan(counts_RE, previous)

    def calibrate(self) -> StepCost:
        """Collective: a :class:`StepCost` from this layer's measured steps, agreed across
        ranks (element-wise max); ``balance="auto"`` plans with it from the next step."""
        self._lane.drain()
        home = {name: self.store.local[name][: self.M] for name in self.store.local}
        return self.balancer.calibrate(
            self.group,
            copy_fallback_s=time_local_copy(home),
            overlap=self.lane().kind != "inline",
        )

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
        ok: bool,
        msg: str,
    ) -> torch.Tensor:
        """One step; every rank calls it (also with zero tokens)."""
        self._lane.drain()  # a failed step's background job, before buffers change
        if self.balancer.due():  # "auto" after its measured warm-up steps (every rank)
            self.calibrate()
        rec = self.profiler.begin_step()  # records nothing unless profiling
        t0 = time.perf_counter()
        counts_E = torch.zeros(self.E, dtype=torch.int64, device=x_SH.device)
        if ok and ids_SK is not None and ids_SK.numel():
            counts_E = torch.bincount(ids_SK.reshape(-1), minlength=self.E)
        # One exchange carries the counts, the validity flag and "my home weights changed".
        version = tuple(int(p._version) for p in params.values())
        changed = int(version != self.published_version)
        got_RX = self.group.gather_with_status(
            torch.cat([counts_E, counts_E.new_tensor([changed])]), ok, msg
        )
        counts_RE = got_RX[:, : self.E]
        if bool(got_RX[:, self.E].any()):  # any rank's weights changed: every slot is stale
            self.published, self.resident = False, None
        t1 = time.perf_counter()
        rec.span("counts", t0, t1)
        plan = self._plan(counts_RE, self.resident)
        self.plans_made += 1
        need = int(plan.recv_size().max())
        while need > self.capacity:  # every rank sees the same plan: all grow together
            self._build(self._capacity_for(need))
            # Without residents "auto" may pick another candidate, with other loads.
            plan = self._plan(counts_RE, None)
            need = int(plan.recv_size().max())
        ids = ids_SK if ids_SK is not None else torch.zeros(0, self.K, dtype=torch.int64)
        # Affinity (a token's records on few ranks) pays only where dispatch sends token
        # rows (docs/design.md §3); per-record transports skip computing it.
        tokens = self.transport.rows == "tokens"
        route = route_tokens(plan, self.group.rank, ids, check=False, affinity=tokens)
        if not self.published:
            self.store.publish_home(params)
            self.published, self.published_version = True, version
        t2 = time.perf_counter()
        rec.span("plan", t1, t2)
        step = MoEStep(self, plan, route, recorder=rec)
        step.fetch = self._start_prefetch(plan)
        t3 = time.perf_counter()
        rec.span("prefetch_exposed", t2, t3)
        step.phases["prefetch_exposed"] = t3 - t2
        y_SH = moe_apply(step, x_SH, weight_SK, params["gate_up"], params["down"])
        fetched = step.fetch.wait()[0]
        self.resident = plan if self.B > 0 else None
        self.last_plan = plan
        s = plan.summary()
        # The same dict as the step's: backward adds its phases to it when it runs.
        step.phases.update({"counts": t1 - t0, "plan": t2 - t1})
        phases = step.phases
        self.last_stats = StepStats(
            s["copies"],
            s["new_copies"],
            fetched,
            s["static_max_over_mean"],
            s["planned_max_over_mean"],
            phases,
            **self._plan_figures(plan),
        )
        self.last_stats.records = step.traffic.get("records", 0)
        self.last_stats.rows_sent = step.traffic.get("rows_sent", 0)
        self.last_stats.bytes_sent = step.traffic.get("bytes_sent", 0)
        rec.traffic(self.last_stats.records, self.last_stats.rows_sent)
        self.balancer.record(plan, self.group.rank, route.dest_rank.numel(), phases)
        return y_SH

    def _start_prefetch(self, plan: Plan) -> Any:
        """Start filling new slots and reading direct rows (the step's ``Pending``).

        Home rows were published behind a barrier, and this rank's previous step
        (backward included) is done with its slots, so the copies need no collective
        on the heap and run beside the dispatch; on the all-to-all path they are
        collectives and run inline (see :mod:`moonplan.runtime.background`).
        """
        store, r = self.store, self.group.rank
        lane = self.lane()
        if lane.kind != "inline" and not _fetches(plan, r):  # nothing to move: no job
            return Pending(result=(0, store.direct(plan)))
        return lane.submit(lambda: (store.prefetch(plan), store.direct(plan)))

    def _plan_figures(self, plan: Plan) -> dict[str, Any]:
        """``direct_reads``, ``policy`` and ``predicted`` of a plan for :class:`StepStats`."""
        d_D = plan.direct_expert()[self.group.rank]
        return {
            "direct_reads": int((d_D >= 0).sum()),
            "policy": plan.policy,
            "predicted": dict(plan.predicted),
        }


def _fetches(plan: Plan, rank: int) -> bool:
    """Whether ``rank`` fills a new slot or reads a direct row under ``plan``."""
    return bool((plan.slot_new[rank] > 0).any()) or bool((plan.direct_expert()[rank] >= 0).any())
