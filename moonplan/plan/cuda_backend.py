"""The fused ``cuda`` planner backend: ``csrc/plan_kernel.cu`` built by NVRTC, run by cuda-python.

Legend:
    R ranks, E experts, B slots per rank, M = ceil(E/R), W = M + max(B, M) rows per rank.

The kernel computes the whole plan of :mod:`moonplan.plan.reference` (bit for bit) on the
device: no value is read on the host, every output shape depends only on ``(R, E, B)``, and
the launches go to torch's current stream, so the call can be captured in a CUDA graph.
Scratch memory comes from ``torch.empty`` on the device (the caching allocator, or the
graph's private pool while capturing).

Compilation: NVRTC compiles the source once per process for each ``(source, arch)`` (an
``lru_cache``), the driver loads it as a context-independent library once per device, and
the main kernel is allowed the device's opt-in shared memory. cuda-python is imported as
``cuda.bindings`` (cuda-python >= 12.6, 13.x) or, for older releases, ``cuda``.

Source lookup (the first folder holding ``plan_kernel.cu`` wins; its ``plan_kernel.cuh`` is
read from the same folder), see ``docs/gpu_planner.md``:
    1. ``$MOONPLAN_CSRC`` (a folder set by the user or a packager);
    2. ``moonplan/_csrc`` inside the installed package (a wheel that ships the sources);
    3. ``csrc`` at the root of a source checkout (editable installs).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.resources
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from moonplan.plan.home import max_local
from moonplan.plan.plan_fields import PlanFields

MAX_RANKS = 1024  # the main kernel keeps one thread per rank in a block scan
MAX_SLOTS = 1 << 16
PREP_THREADS = 256
FUSED_PREP_MAX = 1 << 16  # E*R up to this: the one-block kernel sums counts itself
SOURCE_FILE = "plan_kernel.cu"
HEADER_FILES = ("plan_kernel.cuh",)  # included by SOURCE_FILE
SOURCE_ENV = "MOONPLAN_CSRC"
PREP_KERNEL = "moonplan_plan_prep"
MAIN_KERNEL = "moonplan_plan_main"

Arg = tuple[int | float, Any]  # (value, ctypes type) of one kernel argument


class _Kernels(NamedTuple):
    """The loaded library of one device, its two kernels and the device's primary context."""

    library: Any
    context: Any
    prep: Any
    main: Any
    smem_max: int


# ---- capability --------------------------------------------------------------------------


def available() -> tuple[bool, str]:
    """Whether :func:`plan_cuda` can run here; ``(False, reason)`` naming the missing piece.

    Checks a CUDA device through torch, an importable cuda-python with a loadable NVRTC,
    and the kernel source. Nothing is checked at import time.
    """
    try:
        _require()
    except RuntimeError as exc:
        return False, str(exc)
    return True, ""


def _require() -> None:
    """Raise :class:`RuntimeError` naming the first missing piece of the CUDA backend."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: torch.cuda.is_available() is False")
    nvrtc_version()
    kernel_sources()


@functools.lru_cache(maxsize=1)
def _bindings() -> tuple[Any, Any]:
    """``(nvrtc, driver)`` modules of cuda-python (new and old package layouts)."""
    try:
        return (
            importlib.import_module("cuda.bindings.nvrtc"),
            importlib.import_module("cuda.bindings.driver"),
        )
    except ImportError:
        pass
    try:
        return importlib.import_module("cuda.nvrtc"), importlib.import_module("cuda.cuda")
    except ImportError as exc:
        raise RuntimeError(
            f"cuda-python is not importable (pip install 'cuda-python>=12.6'): {exc}"
        ) from None


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's ``(major, minor)``; raises :class:`RuntimeError` when the library is missing."""
    nvrtc, _ = _bindings()
    try:
        res = nvrtc.nvrtcVersion()
    except Exception as exc:  # cuda-python raises its own loader errors
        raise RuntimeError(
            "the NVRTC library could not be loaded (pip install nvidia-cuda-nvrtc, or put "
            f"the CUDA toolkit's libnvrtc on the library path): {exc}"
        ) from None
    major, minor = _check(res, "nvrtcVersion")
    return int(major), int(minor)


# ---- source and compilation ----------------------------------------------------------------


def source_candidates() -> list[Path]:
    """Where :func:`kernel_sources` looks for ``plan_kernel.cu``, in order."""
    paths = []
    env = os.environ.get(SOURCE_ENV)
    if env:
        paths.append(Path(env) / SOURCE_FILE)
    paths.append(Path(str(importlib.resources.files("moonplan"))) / "_csrc" / SOURCE_FILE)
    paths.append(Path(__file__).resolve().parents[2] / "csrc" / SOURCE_FILE)
    return paths


@functools.lru_cache(maxsize=1)
def kernel_sources() -> tuple[str, tuple[tuple[str, str], ...]]:
    """``(source, ((header name, header text), ...))`` of the planner (read once per process)."""
    paths = source_candidates()
    for path in paths:
        if path.is_file():
            headers = tuple((h, (path.parent / h).read_text()) for h in HEADER_FILES)
            return path.read_text(), headers
    tried = ", ".join(str(p) for p in paths)
    raise RuntimeError(f"the kernel source {SOURCE_FILE} was not found (tried {tried})")


def kernel_source() -> str:
    """The CUDA source of the planner (``plan_kernel.cu``)."""
    return kernel_sources()[0]


@functools.lru_cache(maxsize=16)
def compile_cubin(
    source: str,
    arch: tuple[int, int],
    headers: tuple[tuple[str, str], ...] = (),
    options: tuple[str, ...] = (),
    name: str = SOURCE_FILE,
) -> bytes:
    """Compile ``source`` with NVRTC to a cubin for compute capability ``arch`` (no GPU needed).

    Args:
        source: the ``.cu`` text.
        arch: ``(major, minor)`` compute capability, e.g. ``(9, 0)``.
        headers: ``(name, text)`` of the files ``source`` includes.
        options: more NVRTC options (``--fmad=false`` for the choice kernel's floats).
        name: the source's file name (for NVRTC's messages).

    Raises:
        RuntimeError: NVRTC missing, or the compile log when compilation fails.
    """
    nvrtc, _ = _bindings()
    nvrtc_version()
    names = [n.encode() for n, _ in headers]
    texts = [t.encode() for _, t in headers]
    (prog,) = _check(
        nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), len(headers), texts, names),
        "nvrtcCreateProgram",
    )
    try:
        opts = [f"--gpu-architecture=sm_{arch[0]}{arch[1]}".encode(), b"-std=c++17"]
        opts += [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err) != 0:
            raise RuntimeError(
                f"NVRTC failed to compile {name} for sm_{arch[0]}{arch[1]}:\n" + _nvrtc_log(prog)
            )
        (size,) = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvrtc_log(prog: Any) -> str:
    nvrtc, _ = _bindings()
    (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    log = b" " * size
    _check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
    return log.decode(errors="replace").rstrip("\x00")


@functools.lru_cache(maxsize=16)
def _load(
    sources: tuple[str, tuple[tuple[str, str], ...]], arch: tuple[int, int], device_index: int
) -> _Kernels:
    """Load the compiled library for one device; allow the main kernel all shared memory."""
    _, driver = _bindings()
    cubin = compile_cubin(sources[0], arch, sources[1])
    _check(driver.cuInit(0), "cuInit")
    (library,) = _check(
        driver.cuLibraryLoadData(cubin, None, None, 0, None, None, 0), "cuLibraryLoadData"
    )
    (prep,) = _check(driver.cuLibraryGetKernel(library, PREP_KERNEL.encode()), "cuLibraryGetKernel")
    (main,) = _check(driver.cuLibraryGetKernel(library, MAIN_KERNEL.encode()), "cuLibraryGetKernel")
    (dev,) = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    (smem_max,) = _check(driver.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute")
    fattr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _check(driver.cuKernelSetAttribute(fattr, int(smem_max), main, dev), "cuKernelSetAttribute")
    # torch runs in the device's primary context; retained here for the whole process.
    (ctx,) = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    with _current(ctx):
        for kernel in (prep, main):  # load into the context now, not during a graph capture
            _check(driver.cuKernelGetFunction(kernel), "cuKernelGetFunction")
    prep_f, main_f = driver.CUfunction(int(prep)), driver.CUfunction(int(main))
    return _Kernels(library, ctx, prep_f, main_f, int(smem_max))


@contextlib.contextmanager
def _current(ctx: Any) -> Iterator[None]:
    """Make ``ctx`` the calling thread's current driver context for the block."""
    _, driver = _bindings()
    _check(driver.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield
    finally:
        _check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")


def _check(result: Any, what: str) -> tuple[Any, ...]:
    """Unpack a cuda-python ``(status, *values)`` tuple; raise on a failed status."""
    status, *values = result
    if int(status) != 0:
        raise RuntimeError(f"{what} failed: {_describe(status)}")
    return tuple(values)


def _describe(status: Any) -> str:
    name = getattr(status, "name", str(status))
    try:
        _, driver = _bindings()
        if not isinstance(status, driver.CUresult):  # an NVRTC status: its name says it all
            return str(name)
        err, text = driver.cuGetErrorString(status)
        if int(err) == 0 and text:
            return f"{name} ({text.decode()})"
    except Exception:  # not a driver status, or no driver: the name is enough
        pass
    return str(name)


# ---- sizes, buffers, arguments (host side only, no device reads) -------------------------------


def block_threads(R: int) -> int:
    """Threads of the one-block main kernel: a warp per rank, 128 to 1024."""
    return min(1024, max(128, 32 * R))


def prep_blocks(R: int, E: int) -> int:
    """Blocks of the prep kernel (grid-stride loops over ``E*R``)."""
    return max(1, min(4096, -(-(E * R) // PREP_THREADS)))


def shared_bytes(R: int, E: int) -> int:
    """Dynamic shared memory of the main kernel (the layout of `MpShared` in plan_kernel.cu)."""
    return 8 * (E + 3 * R + 33) + 4 * (5 * R + 1 + 33)


def allocate(
    R: int, E: int, B: int, device: torch.device, with_prev: bool
) -> tuple[PlanFields, dict[str, torch.Tensor]]:
    """Uninitialised int64 outputs (the plan's layout tensors) and the kernel's scratch.

    All are views of one int64 allocation (one allocator call instead of fourteen, a
    host cost of every call), each starting on an 8-byte boundary.

    Returns:
        ``(out, scratch)``: ``out`` the :class:`PlanFields` (in the buffer in the order
        below, ``flow`` first); ``scratch`` (by name) holds ``total_E [E]`` and
        ``rep_c [R*M]`` (int64), ``rep_e``, ``srt_e [R*M]`` and ``warm_d [R*B]`` (int32).
    """
    M = max_local(E, R)
    W = M + max(B, M)
    shapes64: dict[str, tuple[int, ...]] = {
        "flow": (max(R - 1, 0), 3),
        "alloc": (E, R),
        "target": (R,),
        "home": (E,),
        "slot_expert": (R, B),
        "slot_new": (R, B),
        "row_expert": (R, W),
        "row_count": (R, W),
        "row_offset": (R, W + 1),
        "total_E": (E,),
        "rep_c": (R * M,),
    }
    sizes32 = {"rep_e": R * M, "srt_e": R * M, "warm_d": R * B if with_prev else 1}
    words = sum(math.prod(s) for s in shapes64.values()) + sum(
        (n + 1) // 2 for n in sizes32.values()
    )
    buf = torch.empty(words, dtype=torch.int64, device=device)
    views: dict[str, torch.Tensor] = {}
    at = 0
    for name, shape in shapes64.items():
        views[name] = buf[at : at + math.prod(shape)].view(shape)
        at += math.prod(shape)
    for name, n in sizes32.items():
        views[name] = buf[at : at + (n + 1) // 2].view(torch.int32)[:n]
        at += (n + 1) // 2
    scratch_names = ("total_E", "rep_c", *sizes32)
    out = PlanFields(**{k: views[k] for k in PlanFields._fields})
    return out, {k: views[k] for k in scratch_names}


def kernel_args(
    counts_RE: torch.Tensor,
    prev_RB: torch.Tensor | None,
    prev_F3: torch.Tensor | None,
    B: int,
    align: int,
    out: PlanFields,
    scratch: dict[str, torch.Tensor],
) -> tuple[list[Arg], list[Arg], bool]:
    """``(prep_args, main_args, fused)``: the argument lists of the two kernels, in order.

    ``fused`` is True when the main kernel does the prep work itself (small ``E*R``); then
    the prep kernel is not launched.
    """
    R, E = counts_RE.shape
    fused = E * R <= FUSED_PREP_MAX

    def ptr(t: torch.Tensor) -> Arg:
        return (t.data_ptr(), ctypes.c_void_p)

    def val(v: int) -> Arg:
        return (int(v), ctypes.c_longlong)

    dummy = scratch["warm_d"]  # passed for an absent input, never read
    prev = prev_RB if prev_RB is not None else dummy
    flows = prev_F3 if prev_F3 is not None else dummy
    n_flows = 0 if prev_F3 is None else prev_F3.shape[0]
    prep_args = [ptr(counts_RE), val(R), val(E), ptr(out.alloc), ptr(out.home)]
    prep_args.append(ptr(scratch["total_E"]))
    main_args = [ptr(counts_RE), ptr(prev), ptr(flows), val(R), val(E), val(B), val(align)]
    main_args += [val(prev_RB is not None), val(n_flows), val(fused)]
    main_args += [ptr(t) for t in (out.alloc, out.home, out.target, out.flow)]
    main_args += [ptr(out.slot_expert), ptr(out.slot_new)]
    main_args += [ptr(t) for t in (out.row_expert, out.row_count, out.row_offset)]
    main_args += [ptr(scratch[k]) for k in ("total_E", "rep_c", "rep_e", "srt_e", "warm_d")]
    return prep_args, main_args, fused


# ---- the backend ------------------------------------------------------------------------------


def plan_cuda(
    counts_RE: torch.Tensor,
    B: int,
    align: int,
    prev_slot_RB: torch.Tensor | None,
    prev_flow_F3: torch.Tensor | None = None,
) -> PlanFields:
    """The plan's layout tensors from the fused kernel (``reference.to_tensors``').

    Args:
        counts_RE: integer ``[R, E]`` counts on a CUDA device, non-negative (not checked
            here: checking reads the device).
        B: slots per rank (``>= 0``).
        align: row padding multiple (``>= 1``).
        prev_slot_RB: int64 ``[R, B]`` slots of the previous plan on the same device
            (ids in ``[-1, E)``), or ``None``.
        prev_flow_F3: int64 ``[F, 3]`` flows ``(donor, receiver, records)`` of the previous
            plan in decision order (``Plan.flow``, ``F = R-1``; rows with a negative donor
            are padding), or ``None``.

    Returns:
        :class:`PlanFields`, int64 tensors on ``counts_RE.device``, written
        asynchronously on torch's current stream.

    Raises:
        RuntimeError: the backend is unavailable (the message names the missing piece) or
            the sizes exceed the kernel's limits.
        ValueError: bad shapes, dtypes or devices.
    """
    _require()
    counts_RE = _check_counts(counts_RE, B, align)
    R, E = counts_RE.shape
    prev_RB = _check_prev(prev_slot_RB, (R, B), counts_RE.device, "prev_slot_RB")
    prev_F3 = _check_prev(prev_flow_F3, (-1, 3), counts_RE.device, "prev_flow_F3")
    device = counts_RE.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    kernels = _load(kernel_sources(), torch.cuda.get_device_capability(index), index)
    smem = shared_bytes(R, E)
    if smem > kernels.smem_max:
        raise RuntimeError(
            f"the CUDA planner needs {smem} bytes of shared memory for E={E}, R={R}; this "
            f"device allows {kernels.smem_max} (use backend='torch')"
        )
    out, scratch = allocate(R, E, B, device, prev_RB is not None)
    prep_args, main_args, fused = kernel_args(counts_RE, prev_RB, prev_F3, B, align, out, scratch)
    stream = torch.cuda.current_stream(device).cuda_stream
    # A kernel launched on a stream runs in the stream's context; on the default streams
    # (handles 0, 1, 2: legacy, per-thread) in the current one, so make it torch's.
    ctx = _current(kernels.context) if stream <= 2 else contextlib.nullcontext()
    with torch.cuda.device(index), ctx:
        if not fused:
            _launch(kernels.prep, prep_blocks(R, E), PREP_THREADS, 0, stream, prep_args)
        _launch(kernels.main, 1, block_threads(R), smem, stream, main_args)
    return out


def _check_counts(counts_RE: torch.Tensor, B: int, align: int) -> torch.Tensor:
    """Shape, dtype, device and limits (no device reads); a contiguous int64 tensor."""
    if not isinstance(counts_RE, torch.Tensor) or counts_RE.dim() != 2:
        raise ValueError("counts_RE must be a 2-D tensor [R, E]")
    if counts_RE.device.type != "cuda":
        raise ValueError(f"the cuda backend needs counts on a CUDA device, got {counts_RE.device}")
    if counts_RE.dtype.is_floating_point or counts_RE.dtype.is_complex:
        raise ValueError(f"counts must have an integer dtype, got {counts_RE.dtype}")
    R, E = counts_RE.shape
    if R < 1 or E < 1:
        raise ValueError(f"counts must have at least one rank and one expert, got {(R, E)}")
    if R > MAX_RANKS:
        raise RuntimeError(f"the CUDA planner supports at most {MAX_RANKS} ranks, got R={R}")
    if not 0 <= B <= MAX_SLOTS:
        raise RuntimeError(f"the CUDA planner supports 0 <= B <= {MAX_SLOTS} slots, got B={B}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    return counts_RE.to(torch.int64).contiguous()


def _check_prev(
    t: torch.Tensor | None, shape: tuple[int, int], device: torch.device, name: str
) -> torch.Tensor | None:
    """``t`` as a contiguous int64 tensor of ``shape`` (``-1``: any size) on ``device``."""
    if t is None:
        return None
    ok = t.dim() == 2 and all(w in (-1, n) for w, n in zip(shape, t.shape, strict=True))
    if not ok or t.device != device:
        raise ValueError(
            f"{name} must be {list(shape)} on {device}, got {list(t.shape)} on {t.device}"
        )
    return t.to(torch.int64).contiguous()


def _launch(kernel: Any, grid: int, block: int, smem: int, stream: int, args: list[Arg]) -> None:
    """Launch ``kernel`` on ``stream`` with ``args`` (cuda-python's (values, types) form)."""
    _, driver = _bindings()
    params = (tuple(v for v, _ in args), tuple(t for _, t in args))
    res = driver.cuLaunchKernel(
        kernel, grid, 1, 1, block, 1, 1, smem, driver.CUstream(stream), params, 0
    )
    _check(res, "cuLaunchKernel")
