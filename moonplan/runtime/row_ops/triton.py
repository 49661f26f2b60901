"""Row movement in Triton: peer-pointer kernels through a table of peer base addresses.

Legend:
    R ranks, S tokens of this rank, K top-k, N = S*K records (flat, token-major),
    H hidden size, ``cap_r`` rows of rank ``r``'s buffer, n rows to copy, L elements per row.
    ``table_R``: int64 ``data_ptr()`` of each rank's view, loaded in the kernel and cast
    with ``.to(tl.pointer_type(...))``.

Each launcher has the signature of its torch twin in :mod:`moonplan.runtime.row_ops.torch`
(plus ``check=``) and gives bit-identical results: they only copy rows (bits move
unchanged).

Triton is imported only when a launcher runs. Kernels are compiled for CUDA tensors,
or interpreted for CPU tensors under ``TRITON_INTERPRET=1`` (read when the kernels
are first built in a process; then the CPU views may be shm-mapped peers). Tiles are
:class:`Blocks` (no autotune: the interpreter cannot autotune); a launcher takes
``blocks=`` to try others (``bench/gpu_runtime_check.py`` times a few).

Bandwidth. A program moves a ``[rows, cols]`` tile (default 4 rows x 1024 elements, 4
warps: 8 KB of bf16, four 16-byte vectors a thread). A peer's row address comes from
the table, so the compiler cannot prove its alignment and falls back to 2-byte
accesses (seen in the sm_90 PTX: ``st.global.b16`` in the scatter, ``ld.global.b16``
in the gather). Where the launcher has checked that every view's base address and
row stride are multiples of 16 bytes (``ALIGNED``; the heap's allocations are
256-byte aligned), the kernels say so with ``tl.multiple_of`` and the accesses become
16-byte vectors (``st.global.v4.b32`` / ``ld.global.v4.b32``; a test compiles both
kernels for sm_90 on the CPU and checks). On an H200 (2026-12-04) they ran at 74%
(scatter) and 63% (gather) of a device copy with the default tile (docs/benchmarks.md).

Interpreter notes (Triton 3.9): ``triton.jit`` reads ``TRITON_INTERPRET`` when it
decorates, so triton's own ``@jit`` helpers (``tl.cdiv``, ``tl.zeros``, ...) take the
mode of the moment ``triton.language`` was first imported; the kernels below use only
builtins so that they work whatever that order was.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from moonplan.runtime.row_ops.torch import _check_records, _check_views, check_index_shapes

VECTOR_BYTES = 16  # the widest global load/store (a 128-bit vector)


@dataclass(frozen=True)
class Blocks:
    """One program's tile: ``rows`` rows x ``cols`` elements (powers of two; ``cols`` is
    capped at the row length's next power of two), run by ``warps`` warps."""

    rows: int = 4
    cols: int = 1024
    warps: int = 4

    def tile(self, length: int) -> tuple[int, int]:
        """``(rows, cols)`` for rows of ``length`` elements."""
        return self.rows, min(self.cols, max(16, 1 << max(length - 1, 0).bit_length()))


SCATTER = Blocks()  # scatter_rows' default tile
GATHER = Blocks()  # gather_rows' default tile


def _interpreting() -> bool:
    """Whether Triton would build interpreted kernels now (``TRITON_INTERPRET``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether the kernels can run (on ``device``, or anywhere if ``None``), and why not.

    Needs triton, and either a CUDA device (compiled) or ``TRITON_INTERPRET=1`` (CPU
    tensors, interpreted).
    """
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return False, f"triton is not installed ({err})"
    kind = None if device is None else torch.device(device).type
    if _interpreting():
        if kind in (None, "cpu"):
            return True, "Triton interpreter (TRITON_INTERPRET=1) on CPU tensors"
        return False, f"TRITON_INTERPRET=1 runs kernels on CPU tensors only, not {kind}"
    if kind == "cpu":
        return False, "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)"
    if kind not in (None, "cuda") or not torch.cuda.is_available():
        return False, "no CUDA device (and TRITON_INTERPRET is not 1)"
    return True, f"compiled for CUDA ({torch.cuda.get_device_name()})"


# ---- launchers -----------------------------------------------------------------------------
def scatter_rows(
    x_SH: Tensor, dest_rank_N: Tensor, dest_offset_N: Tensor, top_k: int, recv_views: list[Tensor],
    *, check: bool = True, blocks: Blocks = SCATTER,
) -> None:  # fmt: skip
    """Kernel twin of :func:`moonplan.runtime.row_ops.torch.scatter_rows` (same arguments).

    ``check`` also bounds-checks every destination row against its view (host read);
    turn it off only for inputs known to be valid (a bad row is a wild store).
    ``blocks``: the tile (module docstring).
    """
    _check_views(recv_views, x_SH.dtype, x_SH.shape[1:])
    S = x_SH.shape[0]
    dev, rank_N, off_N = _records(x_SH, recv_views, (dest_rank_N, dest_offset_N), S * top_k, check)
    N, H = rank_N.numel(), x_SH.shape[1]
    if N == 0 or H == 0:
        return
    x_SH = _rows_contiguous(x_SH)
    go = _geometry(recv_views, x_SH, N, H, blocks)
    with _on(dev):
        _kernels(_interpreting()).scatter[go.grid](
            x_SH, x_SH.stride(0), rank_N, off_N, go.table_R, go.stride, N, H,
            TOP_K=top_k, BLOCK_N=go.rows, BLOCK_H=go.cols, ALIGNED=go.aligned,
            num_warps=blocks.warps,
        )  # fmt: skip


def gather_rows(
    src_views: list[Tensor],
    src_rank_N: Tensor,
    src_row_N: Tensor,
    dst: Tensor,
    *,
    check: bool = True,
    blocks: Blocks = GATHER,
) -> None:
    """Kernel twin of :func:`moonplan.runtime.row_ops.torch.gather_rows` (same arguments).

    Each view's and ``dst``'s rows must be contiguous (trailing dimensions row-major).
    ``check`` also bounds-checks every source row against its view (host read).
    ``blocks``: the tile (module docstring).
    """
    L = _check_views(src_views, dst.dtype, dst.shape[1:])
    dev, rank_N, row_N = _records(dst, src_views, (src_rank_N, src_row_N), dst.shape[0], check)
    n = rank_N.numel()
    if n == 0 or L == 0:
        return
    if not _rows_are_dense(dst):
        raise ValueError(f"dst rows must be contiguous, got strides {dst.stride()}")
    go = _geometry(src_views, dst, n, L, blocks)
    with _on(dev):
        _kernels(_interpreting()).gather[go.grid](
            rank_N, row_N, go.table_R, go.stride, dst, dst.stride(0), n, L,
            BLOCK_N=go.rows, BLOCK_L=go.cols, ALIGNED=go.aligned, num_warps=blocks.warps,
        )  # fmt: skip


# ---- helpers --------------------------------------------------------------------------------
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _records(
    local: Tensor,
    views: list[Tensor],
    index_N: tuple[Tensor, Tensor],
    count: int,
    check: bool,
) -> tuple[torch.device, Tensor, Tensor]:
    """``(device, rank_N, row_N)`` of a launch: the launch device (:func:`_device`, from
    this rank's ``local`` tensor), the ``count`` records' ranks and rows in the views as
    flat int64 on it, and with ``check`` every record and row checked against the views."""
    dev = _device(local, views)
    rank_N, row_N = _indices(*index_N, dev, count)
    if check:
        _check_records(rank_N, row_N, count, len(views))
        _check_rows(rank_N, row_N, views)
    return dev, rank_N, row_N


@dataclass(frozen=True)
class _Geometry:
    """How a launch covers ``n`` rows of ``L`` elements: the views' base addresses
    (int64 ``[R]``) and common row stride, the tile, the grid, and whether every access
    is 16-byte aligned (module docstring, "Bandwidth")."""

    table_R: Tensor
    stride: int
    rows: int
    cols: int
    grid: tuple[int]
    aligned: bool


def _geometry(views: list[Tensor], local: Tensor, n: int, L: int, blocks: Blocks) -> _Geometry:
    """The :class:`_Geometry` of moving ``n`` rows of ``L`` elements between the peers'
    ``views`` and this rank's ``local`` rows, in ``blocks`` tiles."""
    table_R, stride = _table(views, local.device)
    rows, cols = blocks.tile(L)
    grid = (_cdiv(n, rows) * _cdiv(L, cols),)
    aligned = _aligned(views, stride) and _aligned([local], local.stride(0))
    return _Geometry(table_R, stride, rows, cols, grid, aligned)


def _device(t: torch.Tensor, views: list[torch.Tensor]) -> torch.device:
    """The launch device; raises if the tensors cannot run in the current Triton mode."""
    ok, why = available(t.device)
    if not ok:
        raise RuntimeError(f"moonplan Triton kernels cannot run: {why}")
    for r, v in enumerate(views):
        if v.device.type != t.device.type:
            raise ValueError(f"view of rank {r} is on {v.device}, expected {t.device.type}")
    return t.device


def _on(dev: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``dev`` torch's current device for a launch: Triton launches on the current
    device's current stream, whatever device the tensors are on."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def _indices(
    rank_N: torch.Tensor, row_N: torch.Tensor, dev: torch.device, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat contiguous int64 copies on the launch device; dtypes and sizes checked."""
    check_index_shapes(rank_N, row_N, count)
    return (
        rank_N.to(dev, torch.int64).reshape(-1).contiguous(),
        row_N.to(dev, torch.int64).reshape(-1).contiguous(),
    )


def _check_rows(rank_N: torch.Tensor, row_N: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Every row lies inside its rank's view (one host read)."""
    if rank_N.numel() == 0:
        return
    cap_R = torch.tensor([v.shape[0] for v in views], device=rank_N.device)
    bad_N = (row_N < 0) | (row_N >= cap_R[rank_N])
    if bool(bad_N.any()):
        n = int(bad_N.nonzero()[0])
        r = int(rank_N[n])
        raise ValueError(f"row {int(row_N[n])} of rank {r} is outside its {int(cap_R[r])} rows")


def _rows_are_dense(t: torch.Tensor) -> bool:
    """The trailing dimensions of ``t`` are row-major contiguous (any row stride)."""
    return t.dim() < 2 or t.shape[0] == 0 or t[0].is_contiguous()


def _aligned(views: list[torch.Tensor], stride: int) -> bool:
    """Every view starts at a multiple of 16 bytes, and so does every row (``stride``
    elements apart): what the kernels' ``tl.multiple_of`` hints claim."""
    if not views:
        return False
    size = views[0].element_size()
    return (stride * size) % VECTOR_BYTES == 0 and all(
        v.data_ptr() % VECTOR_BYTES == 0 for v in views
    )


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if _rows_are_dense(t) else t.contiguous()


def _table(views: list[torch.Tensor], dev: torch.device) -> tuple[torch.Tensor, int]:
    """``[R]`` int64 base addresses and the common row stride (elements) of ``views``."""
    many = [v.stride(0) for v in views if v.shape[0] > 1]
    stride = many[0] if many else 0  # with at most one row per view only row 0 is addressed
    for r, v in enumerate(views):
        if not _rows_are_dense(v) or (v.shape[0] > 1 and v.stride(0) != stride):
            raise ValueError(
                f"view of rank {r} has strides {v.stride()}; every view needs dense rows "
                f"and one common row stride ({stride})"
            )
    return torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=dev), stride


# ---- kernels (built on first use, once per mode) --------------------------------------------
@functools.cache
def _kernels(interpret: bool) -> Any:
    """The jitted kernels; ``interpret`` (the ``TRITON_INTERPRET`` mode) keys the cache."""
    del interpret  # triton.jit reads TRITON_INTERPRET itself while decorating
    import triton
    import triton.language as tl

    @triton.jit
    def scatter(x_ptr, x_stride, rank_ptr, off_ptr, table_ptr, dst_stride, N, H,
                TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                ALIGNED: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        num_hb = (H + BLOCK_H - 1) // BLOCK_H  # not tl.cdiv (module docstring)
        n = (pid // num_hb) * BLOCK_N + tl.arange(0, BLOCK_N)
        col = (pid % num_hb) * BLOCK_H + tl.arange(0, BLOCK_H)
        n_ok = n < N
        ok = n_ok[:, None] & (col < H)[None, :]
        rank = tl.load(rank_ptr + n, mask=n_ok, other=0)
        off = tl.load(off_ptr + n, mask=n_ok, other=0)
        dst = tl.load(table_ptr + rank, mask=n_ok, other=0)
        dst = dst.to(tl.pointer_type(x_ptr.dtype.element_ty))
        row = tl.load(x_ptr + (n // TOP_K)[:, None] * x_stride + col[None, :], mask=ok)
        out = dst[:, None] + off[:, None] * dst_stride + col[None, :]
        if ALIGNED:  # each row's column block starts 16-byte aligned (launcher-checked)
            out = tl.multiple_of(out, [1, 16])
        tl.store(out, row, mask=ok)

    @triton.jit
    def gather(rank_ptr, row_ptr, table_ptr, src_stride, dst_ptr, dst_stride, n, L,
               BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        num_lb = (L + BLOCK_L - 1) // BLOCK_L
        i = (pid // num_lb) * BLOCK_N + tl.arange(0, BLOCK_N)
        col = (pid % num_lb) * BLOCK_L + tl.arange(0, BLOCK_L)
        i_ok = i < n
        ok = i_ok[:, None] & (col < L)[None, :]
        src = tl.load(table_ptr + tl.load(rank_ptr + i, mask=i_ok, other=0), mask=i_ok, other=0)
        src = src.to(tl.pointer_type(dst_ptr.dtype.element_ty))
        row_off = tl.load(row_ptr + i, mask=i_ok, other=0) * src_stride
        inp = src[:, None] + row_off[:, None] + col[None, :]
        if ALIGNED:  # as in scatter
            inp = tl.multiple_of(inp, [1, 16])
        row = tl.load(inp, mask=ok)
        tl.store(dst_ptr + i[:, None] * dst_stride + col[None, :], row, mask=ok)

    return SimpleNamespace(scatter=scatter, gather=gather)
