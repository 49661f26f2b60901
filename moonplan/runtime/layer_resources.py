"""``LayerResources``: one layer's buffers, background group and lane, built and released.

Legend: R ranks, E experts, M = ceil(E/R), B slots, S refill staging rows, H hidden,
F ffn, C receive capacity.

The base of :class:`~moonplan.runtime.layer_runtime.LayerRuntime` that owns what its
steps run on: the heap, transport, expert store and gradient reducer
(:func:`~moonplan.runtime.buffers.build_buffers`, rebuilt larger when a step's plan needs
more receive rows), the second process group of the worker's all-to-all prefetch and
reduce, and the background lane (:mod:`moonplan.runtime.background`). ``LayerRuntime``
sets every attribute declared here in its constructor, then builds the buffers and takes
the background group; :meth:`LayerResources.close` gives them back.
"""

from __future__ import annotations

import warnings

import torch

from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap
from moonplan.plan.plan_type import Plan
from moonplan.runtime.background import BackgroundLane, collectives_in_thread, lane_kind
from moonplan.runtime.buffers import BufferSpec, build_buffers
from moonplan.runtime.placer import Placer
from moonplan.runtime.refill import Refill
from moonplan.runtime.step_context import StepContext
from moonplan.runtime.store import ExpertStore, GradReducer
from moonplan.runtime.transports.base import Transport


class LayerResources:
    """One layer's buffers, background group and lane (a base of ``LayerRuntime``, which
    sets the attributes below in its constructor)."""

    group: EPGroup
    E: int
    B: int
    M: int
    H: int
    F: int
    S: int  # refill staging rows per rank (moonplan.runtime.refill)
    align: int
    dtype: torch.dtype
    kind: str  # the configured transport ("auto" or a registered name)
    overlap: bool  # overlapped schedule (docs/runtime.md)
    heap: SymmetricHeap | None
    capacity: int  # receive rows
    transport: Transport
    store: ExpertStore
    refill: Refill
    placer: Placer
    resident: Plan | None  # plan whose slots hold valid weights
    published: bool  # the home weights are in the store's shared rows
    _reducer: GradReducer
    _lane: BackgroundLane
    _background: EPGroup | None  # the worker's collectives (all-to-all)
    _options: tuple[tuple[str, object], ...]  # the transport's, read from the environment

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
        self.transport = new.transport
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
