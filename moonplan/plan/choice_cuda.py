"""``policy="auto"`` on the GPU: ``csrc/choice_kernel.cu`` built by NVRTC, three launches.

Legend:
    R ranks, E experts, B slots per rank, M = ceil(E/R), W = M + max(B, M) rows per rank,
    K levels, C = K + 4 candidates (``moonplan.plan.choice.table``), G ranks per domain.

:func:`choose_cuda` makes the same choice as ``moonplan.plan.choice.reference``, bit for bit:
the same plan, ``index``, ``scores``, ``exited``, ``credit``, ``pending`` and ``rounds``. Its
three kernels run on torch's current stream with no host synchronisation, and every shape
depends only on ``(R, E, B, K)``, so the call can be captured in a CUDA graph:

1. ``moonplan_choice_first`` (one block): the counts' column sums, static loads, static EP's
   scores charged ``exit_s`` and ``plan_s``; where ``previous`` has resident replicas, the
   ``placed`` candidate built and scored, and the ``resident`` one where both static and
   placed exceed ``bound.nocopy_s`` (charged ``rent.exit_build_s``: ``exit_s`` and one
   ``round_s`` a rounding); the early-exit bound, the rent-or-buy exit test
   (``choice.rent.exit_rent``) on the least of the exit's plans, the exit flag, the exit's
   index, the credit, ``pending`` and ``rounds`` (of its ``resident`` build, 0 without one);
2. ``moonplan_choice_build`` (``C - 1`` blocks, one per candidate but static): each returns
   at once when the flag is set (and ``resident``'s or ``placed``'s when the first kernel
   built it), else builds its allocation and scores it, its copies charged and free;
   ``resident``'s block, where it builds, writes ``rounds`` (the full call's own build's);
3. ``moonplan_choice_layout`` (one block): the rent-or-buy winner (``choice.rent.settle``;
   the first kernel's on exit) and the credit, the winner's plan fields.

The cost model's rates are kernel arguments (doubles, fixed in a captured graph); outputs
and scratch are views of one ``torch.empty``. The kernels include the exact planner's
source (``csrc/plan_kernel.cu``) for the construction and placement steps and
``csrc/choice_cost.cuh`` for the step-cost formula, and are compiled with ``--fmad=false``
(``docs/gpu_planner.md``, "The choice kernel").
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
from typing import Any, NamedTuple

import torch

from moonplan.plan import cuda_backend as cb
from moonplan.plan.choice.bound import copy_min_s, link_rates
from moonplan.plan.choice.cost_options import check_cost
from moonplan.plan.choice.table import table
from moonplan.plan.home import max_local
from moonplan.plan.plan_fields import PlanFields
from moonplan.stepcost.step_cost import StepCost

SOURCE_FILE = "choice_kernel.cu"
HEADER_FILES = ("plan_kernel.cu", "plan_kernel.cuh", "choice_cost.cuh")  # SOURCE_FILE includes
KERNELS = ("moonplan_choice_first", "moonplan_choice_build", "moonplan_choice_layout")
NVRTC_OPTIONS = ("--fmad=false",)  # no FMA contraction: the scores' floats as Python's
RED_F64 = 8 * 32  # doubles of mc_block_max's shared memory
TILE = 32 * (8 + 1)  # int64 of one warp's staged alloc tile in mc_score (MC_TILE)
STAGE_MAX_R = 1024  # the most ranks mc_score stages alloc for (MC_STAGE_MAX_R)
ACC = 13  # per-rank int64 sums of mc_score
CHOICE_OUTPUTS = ("index", "scores", "exited", "credit", "pending", "rounds")
"""The choice's outputs in ``Choice``'s field order (after ``names``)."""

Arg = cb.Arg
Sources = tuple[str, tuple[tuple[str, str], ...]]


class _Kernels(NamedTuple):
    """The loaded library of one device, its three kernels and the primary context."""

    library: Any
    context: Any
    first: Any
    build: Any
    layout: Any
    smem_max: int


# ---- source, compilation, loading ------------------------------------------------------------


def available() -> tuple[bool, str]:
    """Whether :func:`choose_cuda` can run here; ``(False, reason)`` naming the missing piece."""
    ok, why = cb.available()
    if not ok:
        return ok, why
    try:
        sources()
    except RuntimeError as exc:
        return False, str(exc)
    return True, ""


@functools.lru_cache(maxsize=1)
def sources() -> Sources:
    """``(source, ((header, text), ...))`` of the choice kernel, from the first folder of
    ``cuda_backend.source_candidates()`` that holds it (read once per process)."""
    folders = [p.parent for p in cb.source_candidates()]
    for folder in folders:
        if (folder / SOURCE_FILE).is_file():
            headers = tuple((h, (folder / h).read_text()) for h in HEADER_FILES)
            return (folder / SOURCE_FILE).read_text(), headers
    tried = ", ".join(str(f / SOURCE_FILE) for f in folders)
    raise RuntimeError(f"the kernel source {SOURCE_FILE} was not found (tried {tried})")


def compile_choice(arch: tuple[int, int]) -> bytes:
    """The choice kernel's cubin for compute capability ``arch`` (NVRTC; no GPU needed)."""
    source, headers = sources()
    return cb.compile_cubin(source, arch, headers, NVRTC_OPTIONS, SOURCE_FILE)


@functools.lru_cache(maxsize=16)
def _load(srcs: Sources, arch: tuple[int, int], device_index: int) -> _Kernels:
    """Load the library on one device; allow each kernel the opt-in shared memory."""
    _, driver = cb._bindings()
    cubin = cb.compile_cubin(srcs[0], arch, srcs[1], NVRTC_OPTIONS, SOURCE_FILE)
    cb._check(driver.cuInit(0), "cuInit")
    (library,) = cb._check(
        driver.cuLibraryLoadData(cubin, None, None, 0, None, None, 0), "cuLibraryLoadData"
    )
    (dev,) = cb._check(driver.cuDeviceGet(device_index), "cuDeviceGet")
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    (smem_max,) = cb._check(driver.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute")
    fattr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    kernels = []
    for name in KERNELS:
        (k,) = cb._check(driver.cuLibraryGetKernel(library, name.encode()), "cuLibraryGetKernel")
        cb._check(driver.cuKernelSetAttribute(fattr, int(smem_max), k, dev), "cuKernelSetAttribute")
        kernels.append(k)
    (ctx,) = cb._check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    with cb._current(ctx):
        for k in kernels:  # load into the context now, not during a graph capture
            cb._check(driver.cuKernelGetFunction(k), "cuKernelGetFunction")
    first, build, layout = (driver.CUfunction(int(k)) for k in kernels)
    return _Kernels(library, ctx, first, build, layout, int(smem_max))


# ---- sizes and the buffer (host side only, no device reads) -----------------------------------


def block_threads(R: int) -> int:
    """Threads of every block: a warp per rank, 128 to 1024 (at least one thread per rank)."""
    return cb.block_threads(R)


def shared_bytes(R: int, E: int) -> tuple[int, int, int]:
    """Dynamic shared memory of the three kernels (the layouts in ``choice_kernel.cu``); the
    first and the build kernel also build and score the ``resident`` candidate and build
    ``placed`` (its lowest away holder of each expert: ``E`` int32)."""
    first = 8 * (7 * R + 33) + 8 * RED_F64 + 4 * E
    construct = 8 * (E + 3 * R + 33) + 4 * (5 * R + 1 + 33)
    resident = 8 * (R + 33) + 4 * (R + 33)  # its holders' arrays: global scratch (res_a, res_i)
    tiles = 8 * TILE * (block_threads(R) // 32) if R <= STAGE_MAX_R else 0
    score = 8 * (ACC * R) + 8 * RED_F64 + tiles
    placed = 4 * E
    return (
        max(first, resident, score, placed),
        max(construct, resident, score, placed),
        8 * E + 4 * (R + 1),
    )


class Layout(NamedTuple):
    """Where each output and scratch array lies in the int64 buffer (offsets in words)."""

    words: int
    out: dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]]  # name -> offset, shape, strides
    scratch: dict[str, int]  # name -> offset


def resident_holders(R: int, E: int, B: int) -> int:
    """The most holders the resident candidate has: each expert's home and the experts in
    each rank's first ``min(B, M)`` slots (``res_a``, ``res_i`` of :func:`layout`)."""
    return E + R * min(B, max_local(E, R))


@functools.lru_cache(maxsize=64)
def layout(R: int, E: int, B: int, C: int) -> Layout:
    """The buffer of :func:`allocate`: the plan's fields, ``index``, ``scores``, ``credit``
    and ``pending`` (float64), ``exited`` (its first byte, bool), ``rounds`` (int64), then
    the kernels' scratch."""
    M = max_local(E, R)
    W = M + max(B, M)
    F = max(R - 1, 0)
    H = resident_holders(R, E, B)
    out_shapes: dict[str, tuple[int, ...]] = {
        "flow": (F, 3), "alloc": (E, R), "target": (R,), "home": (E,),
        "slot_expert": (R, B), "slot_new": (R, B), "row_expert": (R, W), "row_count": (R, W),
        "row_offset": (R, W + 1), "index": (), "scores": (C,), "exited": (), "credit": (),
        "pending": (), "rounds": (),
    }  # fmt: skip
    words64 = {"total_E": E, "load_R": R, "send_R": R, "sdom_R": R, "misc": 5,
               "alloc_C": C * E * R, "flow_C": C * 3 * F, "recv_C": C * R, "rep_c": C * R * M,
               "res_a": 2 * H, "rest_RE": R * E, "top_RM": R * M, "free_C": C + 2}  # fmt: skip
    words32 = {"rep_e": C * R * M, "srt_e": R * M, "warm_d": max(1, R * B),
               "res_i": E + 1 + 3 * H}  # fmt: skip
    at, out, scratch = 0, {}, {}
    for name, shape in out_shapes.items():
        strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        out[name] = (at, shape, strides)
        at += max(1, math.prod(shape))
    for name, n in words64.items():
        scratch[name] = at
        at += n
    for name, n in words32.items():
        scratch[name] = at
        at += (n + 1) // 2
    return Layout(at, out, scratch)


def allocate(
    R: int, E: int, B: int, C: int, device: torch.device
) -> tuple[torch.Tensor, PlanFields, tuple[torch.Tensor, ...]]:
    """``(buffer, fields, choice)``: one uninitialised int64 buffer and the views of the
    outputs: the plan's layout tensors (int64) and the choice's ``(index, scores, exited,
    credit, pending, rounds)``: ``index`` int64 0-d, ``scores`` float64 ``[C]``, ``exited``
    bool 0-d (the first byte of its word), ``credit`` and ``pending`` float64 0-d, ``rounds``
    int64 0-d (the first kernel writes it every call, the build kernel's ``resident`` block
    again where it builds). One ``as_strided`` per view: the host cost of every call (about
    half that of a slice and a ``view``)."""
    lay = layout(R, E, B, C)
    buf = torch.empty(lay.words, dtype=torch.int64, device=device)

    def view(name: str) -> torch.Tensor:
        at, shape, strides = lay.out[name]
        if name in ("scores", "credit", "pending"):
            return buf.view(torch.float64).as_strided(shape, strides, at)
        if name == "exited":
            return buf.view(torch.bool).as_strided((), (), 8 * at)
        return buf.as_strided(shape, strides, at)

    choice = tuple(view(k) for k in CHOICE_OUTPUTS)
    return buf, PlanFields(*(view(k) for k in PlanFields._fields)), choice


def cost_args(cost: StepCost, R: int) -> list[Arg]:
    """``MC_COST_PARAMS`` of the kernels: ``tile``, ``G``, ``overlap``, then the rates
    (seconds, doubles; ``round_s`` the field: the kernel derives ``rent.exit_build_s`` and
    ``resident.least_units`` from it) and the bound's ``copy_min_s`` (``inf``: no copy
    possible) and ``link_rates`` (dispatch, combine), computed here as the reference computes
    them."""
    check_cost(cost)  # PlanError: an option no form of the choice models
    ints = [cost.tile_rows, cost.domain_size(R), int(cost.overlap)]
    rates = [cost.row_flop_s, cost.weight_read_s, cost.row_mem_s, cost.copy_s_intra,
             cost.copy_s_inter, cost.dispatch_row_s_intra, cost.dispatch_row_s_inter,
             cost.combine_row_s_intra, cost.combine_row_s_inter, cost.base_latency_s,
             cost.per_peer_latency_s, cost.plan_s, cost.exit_s, cost.round_s,
             copy_min_s(cost, R), *link_rates(cost, R)]  # fmt: skip
    args: list[Arg] = [(int(v), ctypes.c_longlong) for v in ints]
    return args + [(float(v), ctypes.c_double) for v in rates]


def kernel_args(
    counts_RE: torch.Tensor,
    prev: tuple[torch.Tensor | None, torch.Tensor | None],
    sizes: tuple[int, int, int],
    cost: StepCost,
    buf: torch.Tensor,
    carry: torch.Tensor,
) -> tuple[list[Arg], list[Arg], list[Arg]]:
    """The argument lists of the three kernels, in order (``sizes = (B, align, levels)``;
    ``prev`` the previous plan's ``(slot_expert [R, B], flow [F, 3])`` or ``None``s;
    ``carry`` its ``(credit, pending)``, float64 ``[2]`` (:func:`carry_of`), read by the
    first kernel)."""
    R, E = counts_RE.shape
    B, align, levels = sizes
    C = levels + 4
    lay = layout(R, E, B, C)
    base = buf.data_ptr()

    def at(name: str) -> Arg:
        off = lay.out[name][0] if name in lay.out else lay.scratch[name]
        return (base + 8 * off, ctypes.c_void_p)

    def val(v: int) -> Arg:
        return (int(v), ctypes.c_longlong)

    prev_RB, prev_F3 = prev
    dummy = at("warm_d")  # passed for an absent input, never read
    p = dummy if prev_RB is None else (prev_RB.data_ptr(), ctypes.c_void_p)
    f = dummy if prev_F3 is None else (prev_F3.data_ptr(), ctypes.c_void_p)
    n_flows = 0 if prev_F3 is None else prev_F3.shape[0]
    c = (counts_RE.data_ptr(), ctypes.c_void_p)
    has = val(prev_RB is not None)
    cost_ = cost_args(cost, R)
    stats = [at(k) for k in ("total_E", "load_R", "send_R", "sdom_R", "misc")]
    carried = (carry.data_ptr(), ctypes.c_void_p)
    first = [c, p, val(R), val(E), val(B), has, val(C), *cost_, carried]
    first += [at("scores"), at("free_C"), at("exited"), at("index"), at("credit")]
    first += [at("pending"), at("rounds"), *stats]
    first += [at(k) for k in ("warm_d", "rest_RE", "top_RM", "alloc_C", "recv_C", "res_a")]
    first += [at("res_i")]
    build = [c, p, f, val(R), val(E), val(B), has, val(n_flows), val(levels), *cost_]
    build += [at("exited"), at("scores"), *stats, at("warm_d")]
    build += [at(k) for k in ("alloc_C", "flow_C", "recv_C", "rep_c", "rep_e")]
    build += [at("res_a"), at("res_i"), at("free_C"), at("rounds")]
    fields = ("alloc", "home", "target", "flow", "slot_expert", "slot_new", "row_expert",
              "row_count", "row_offset")  # fmt: skip
    last = [p, val(R), val(E), val(B), val(align), has, val(C), at("exited"), at("scores")]
    last += [at("index"), *(at(k) for k in fields), at("total_E"), at("load_R")]
    last += [at(k) for k in ("alloc_C", "flow_C", "recv_C", "rep_c", "rep_e", "srt_e")]
    last += [at("free_C"), at("credit")]
    return first, build, last


# ---- the call ----------------------------------------------------------------------------------


def choose_cuda(
    counts_RE: torch.Tensor,
    num_slots: int,
    align: int,
    prev: tuple[torch.Tensor | None, torch.Tensor | None],
    cost: StepCost,
    levels: int,
    carried: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[PlanFields, tuple[torch.Tensor, ...]]:
    """The ``auto`` plan's layout tensors and ``(index 0-d int64, scores [C] float64, exited 0-d
    bool, credit 0-d float64, pending 0-d float64, rounds 0-d int64)``, all on the counts'
    CUDA device, written asynchronously on torch's stream (``rounds``: of the ``resident``
    build this call ran, its roundings together: the early exit's where it built one, else
    in a full call the full call's own, 0 where the exit was taken without one:
    ``Choice.rounds``).

    Args:
        counts_RE: validated integer counts ``[R, E]`` on a CUDA device (not read here).
        num_slots, align: ``B`` and the row padding.
        prev: the previous plan's ``slot_expert [R, B]`` and ``flow [R-1, 3]`` on the same
            device, or ``(None, None)``.
        cost: the step-cost model (``dispatch="record"``).
        levels: ``K`` (``moonplan.plan.choice.table.LEVELS``).
        carried: the previous plan's ``(Choice.credit, Choice.pending)`` (0-d each), or
            ``None`` for 0 each.

    Raises:
        RuntimeError: the backend is unavailable (the message names the missing piece) or
            the sizes exceed the kernels' limits.
        ValueError: bad shapes, dtypes or devices.
        PlanError: a cost option the choice does not model (``choice.cost_options``).
    """
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    C = len(table(levels))  # levels + 4; raises ValueError unless levels >= 1
    counts_RE = cb._check_counts(counts_RE, num_slots, align)
    R, E = counts_RE.shape
    dev = counts_RE.device
    prev_RB = cb._check_prev(prev[0], (R, num_slots), dev, "prev_slot_RB")
    prev_F3 = cb._check_prev(prev[1], (-1, 3), dev, "prev_flow_F3")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    kernels = _load(sources(), torch.cuda.get_device_capability(index), index)
    smem = shared_bytes(R, E)
    if max(smem) > kernels.smem_max:
        raise RuntimeError(
            f"the CUDA choice needs {max(smem)} bytes of shared memory for E={E}, R={R}; this "
            f"device allows {kernels.smem_max} (use backend='torch')"
        )
    buf, fields, choice = allocate(R, E, num_slots, C, dev)
    carry = carry_of(carried, dev)
    args = kernel_args(counts_RE, (prev_RB, prev_F3), (num_slots, align, levels), cost, buf, carry)
    stream = torch.cuda.current_stream(dev).cuda_stream
    ctx = cb._current(kernels.context) if stream <= 2 else contextlib.nullcontext()
    threads = block_threads(R)
    with torch.cuda.device(index), ctx:
        cb._launch(kernels.first, 1, threads, smem[0], stream, args[0])
        cb._launch(kernels.build, C - 1, threads, smem[1], stream, args[1])
        cb._launch(kernels.layout, 1, threads, smem[2], stream, args[2])
    return fields, choice


def carry_of(
    carried: tuple[torch.Tensor, torch.Tensor] | None, device: torch.device
) -> torch.Tensor:
    """float64 ``[2]`` on ``device``: ``(credit, pending)`` for the first kernel (0 each for
    ``None``; no host read)."""
    if carried is None:
        return torch.zeros(2, dtype=torch.float64, device=device)
    for name, x in zip(("credit", "pending"), carried, strict=True):
        if x.numel() != 1:
            raise ValueError(f"{name} must hold one value, got shape {tuple(x.shape)}")
    parts = [x.reshape(()).to(device=device, dtype=torch.float64) for x in carried]
    return torch.stack(parts).contiguous()
