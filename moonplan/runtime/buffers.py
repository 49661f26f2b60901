"""A layer's collective buffers (heap, transport, expert store), built all or nothing.

Legend: R ranks, E experts, M = ceil(E/R), B slots, S refill staging rows, H hidden,
F ffn, C receive capacity.

:func:`build_buffers` is what :meth:`LayerResources._build
<moonplan.runtime.layer_resources.LayerResources._build>` swaps in when a step needs more
receive rows. It is transactional: the new heap is created while the old one
still works, and only a complete set is returned. If any rank fails (the heap cannot
be created, e.g. ``/dev/shm`` is full or a file-size limit is hit, or a local
allocation fails), every rank raises the same :class:`ContractError`, whatever was
created is released, and the caller keeps its old buffers and capacity.

Bounded: before anything is allocated, every rank checks that one set of buffers
(:meth:`BufferSpec.heap_bytes`, the heap's size, and what the all-to-all transports
allocate as local tensors alike, plus the local refill staging rows,
:meth:`BufferSpec.staging_bytes`) fits in its device's memory (:func:`memory_bytes`:
physical RAM for the CPU, the GPU's total memory for CUDA); where it does not on some
rank, every rank raises the same ``ContractError`` naming the bytes, the limit and what
asked for them (``max_tokens``, ``align`` and ``slots`` at construction, a step's
plan when the buffers grow). ``slots`` is capped at ``E`` before (``slot_budget``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from moonplan.comm.errors import HeapUnavailable
from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap
from moonplan.comm.heap_factory import create_heap
from moonplan.runtime.slot_budget import expert_bytes
from moonplan.runtime.store import ExpertStore, GradReducer
from moonplan.runtime.transports import registry
from moonplan.runtime.transports.base import Transport


@dataclass
class LayerBuffers:
    """One complete set: ``heap`` is ``None`` on the all-to-all transport."""

    capacity: int
    heap: SymmetricHeap | None
    transport: Transport
    store: ExpertStore
    reducer: GradReducer


@dataclass(frozen=True)
class BufferSpec:
    """Sizes of one layer's buffers (identical on every rank)."""

    kind: str  # "auto" or a registered transport name ("heap", "a2a", ...)
    E: int
    B: int
    M: int
    H: int
    F: int
    dtype: torch.dtype
    options: tuple[tuple[str, object], ...] = ()  # the transport's (registry.read_options)
    S: int = 0  # refill staging rows (local tensors, outside the heap)

    def heap_bytes(self, capacity: int) -> int:
        """Bytes per rank: receive and output rows ``[C, H]``, 12 bytes per row for a
        token-row transport's per-record words and weight gradients, weight rows, 64 KiB
        slack."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        weight_rows = (self.M + self.B + max(self.M, self.B)) * expert_bytes(
            self.H, self.F, self.dtype
        )
        return capacity * (2 * self.H * elem + 12) + weight_rows + (1 << 16)

    def staging_bytes(self) -> int:
        """Bytes per rank of the refill staging rows (local, beside the heap; shared by
        every layer of these shapes, counted here for each: the check stays an upper bound)."""
        return self.S * expert_bytes(self.H, self.F, self.dtype)


def memory_bytes(device: torch.device) -> int | None:
    """The bound on one set of a layer's buffers on ``device``: its total memory (the
    host's physical RAM for the CPU, the GPU's for CUDA), ``None`` where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):  # not a POSIX host
            return None
    return None


def build_buffers(
    group: EPGroup, spec: BufferSpec, capacity: int, *, sized: str = ""
) -> LayerBuffers:
    """Collective: a new heap (where the transport uses one), transport and store for
    ``capacity`` receive rows. ``"auto"`` is the heap transport where a heap spans the
    group, else ``"a2a"``. ``sized``: what asked for ``capacity`` (named in the error
    when the buffers would exceed the device's memory).

    Raises:
        ContractError: on every rank, if the buffers exceed :func:`memory_bytes` on some
            rank (before any allocation), or creating the heap or any local allocation
            failed on some rank; nothing created here is left behind.
        HeapUnavailable: on every rank, for ``kind="heap"`` where no heap spans the group.
    """
    what = f"layer buffers for {capacity} receive rows"
    nbytes, limit = spec.heap_bytes(capacity) + spec.staging_bytes(), memory_bytes(group.device)
    over = limit is not None and nbytes > limit
    why = (
        f"they need {nbytes} bytes per rank ({sized}), above the limit of {limit} bytes "
        f"(this rank's {group.device.type} memory)"
    )
    group.agree(not over, why, what=what)
    heap = None
    if spec.kind == "auto" or registry.needs_heap(spec.kind):
        try:
            heap = create_heap(group, spec.heap_bytes(capacity))
        except HeapUnavailable:
            if spec.kind != "auto":
                raise
    try:
        parts, err = _local_parts(group, spec, capacity, heap), ""
    except (MemoryError, RuntimeError, ValueError) as exc:  # e.g. out of memory on one rank
        parts, err = None, f"{type(exc).__name__}: {exc}"
    try:
        group.agree(not err, err, what=what)
    except BaseException:
        if heap is not None:
            heap.close()
        raise
    assert parts is not None
    return parts


def _local_parts(
    group: EPGroup, spec: BufferSpec, capacity: int, heap: SymmetricHeap | None
) -> LayerBuffers:
    name = spec.kind if spec.kind != "auto" else "heap" if heap is not None else "a2a"
    transport = registry.create(
        name,
        group,
        capacity=capacity,
        hidden=spec.H,
        dtype=spec.dtype,
        heap=heap,
        options=dict(spec.options) if spec.kind != "auto" else {},
    )
    if not isinstance(transport, Transport):  # a registered factory's promise, checked once
        raise ValueError(
            f"transport {name!r} made a {type(transport).__name__}, not a Transport: it "
            "lacks members of the protocol (moonplan/runtime/transports/base.py)"
        )
    store = ExpertStore(
        transport,
        num_experts=spec.E,
        num_slots=spec.B,
        hidden=spec.H,
        ffn=spec.F,
        dtype=spec.dtype,
        num_staging=spec.S,
    )
    reducer = GradReducer(store, spec.B + max(0, spec.M - spec.B))
    return LayerBuffers(capacity, heap, transport, store, reducer)
