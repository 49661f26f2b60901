"""A grouped GEMM in Triton: ``y[rows of g] = x[rows of g] @ w[g].T``, the experts' matmul.

Legend:
    T rows, K reduction size, N output columns, G groups (experts)
    ``ends_G [G]``: cumulative row ends (``torch._grouped_mm``'s ``offs``): group ``g``
    owns rows ``[ends[g-1], ends[g])``; rows from ``ends[G-1]`` on belong to no group.
    ``w_GNK [G, N, K]`` (any strides): ``y = x @ w[g].T``; ``w_GNK.transpose(1, 2)``
    gives ``y = x @ w[g]`` (the input gradient) with the same kernel.

:func:`grouped_mm` is the kernel twin of ``torch._grouped_mm(x, w.transpose(-2, -1),
offs=ends)`` as :mod:`moonplan.runtime.experts` calls it, with rows outside every group
set to zero. It exists to be measured against ``torch._grouped_mm`` (cuBLAS/CUTLASS
grouped kernels) by ``bench/gpu_runtime_check.py``: the first GPU session measured
the ``torch._grouped_mm`` SwiGLU at 64.8% of ``torch.mm`` at 8 experts x 8192 rows
(target 70%). The runtime keeps ``torch._grouped_mm`` until a GPU run says otherwise.

Schedule. The M tiles of every group are numbered in group order; a program takes
one (M tile, N tile) pair, the M tile fastest, so programs running together share an
``N x K`` weight tile in L2. Which group a tile belongs to is a ``searchsorted`` on
the device (no host read: the launch can be captured in a CUDA graph); the grid
covers ``ceil(T / BLOCK_M) + G`` M tiles, a bound on the real count, and spare
programs return at once. Each program accumulates ``tl.dot`` products in fp32 over
``K`` and stores ``x``'s dtype. The default tile (128 x 128 x 64, 8 warps, 3 stages) is
a common Hopper choice for bf16; on sm_90 ``tl.dot`` becomes ``wgmma`` (a test checks
the PTX on the CPU). On an H200 (2026-12-04) it equals ``torch._grouped_mm`` at 0.54 of
``torch.mm``'s rate (docs/benchmarks.md); under ``TRITON_INTERPRET=1`` it
equals the float64 product within fp32 rounding (tests). The interpreter has no bf16
arithmetic (numpy), so there bf16 operands are widened to fp32 by their bits (exact)
and the fp32 result is rounded to bf16 by torch; compiled, ``tl.dot`` takes bf16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from moonplan.runtime.row_ops.triton import _interpreting, _on, available


@dataclass(frozen=True)
class GemmTiles:
    """One program's tile ``m x n`` over ``k`` steps, its warps and pipeline stages."""

    m: int = 128
    n: int = 128
    k: int = 64
    warps: int = 8
    stages: int = 3


DEFAULT = GemmTiles()
CANDIDATES = (  # what bench/gpu_runtime_check.py times on a GPU
    GemmTiles(),
    GemmTiles(128, 256, 64, 8, 3),
    GemmTiles(128, 128, 64, 4, 4),
    GemmTiles(64, 128, 64, 4, 4),
)


def grouped_mm(
    x_TK: Tensor, w_GNK: Tensor, ends_G: Tensor, *, tiles: GemmTiles = DEFAULT
) -> Tensor:
    """``[T, N]``: ``x[rows of g] @ w[g].T`` for every group, zero outside every group.

    Args:
        x_TK: ``[T, K]`` fp32/bf16/fp16, unit stride along ``K`` not required.
        w_GNK: ``[G, N, K]`` of ``x``'s dtype and device (any strides).
        ends_G: ``[G]`` integer non-decreasing row ends, ``ends[-1] <= T`` (not checked
            here: ``moonplan.runtime.experts`` checks offsets).
        tiles: the program tile.

    Raises:
        ValueError: shapes, dtypes or devices disagree.
        RuntimeError: Triton cannot run on this device (see ``row_ops.triton.available``).
    """
    _check(x_TK, w_GNK, ends_G)
    ok, why = available(x_TK.device)
    if not ok:
        raise RuntimeError(f"moonplan grouped GEMM cannot run: {why}")
    T, K = x_TK.shape
    G, N, _ = w_GNK.shape
    widen = _interpreting() and x_TK.dtype == torch.bfloat16  # module docstring
    y_TN = torch.zeros(T, N, dtype=torch.float32 if widen else x_TK.dtype, device=x_TK.device)
    if T == 0 or N == 0 or G == 0:
        return y_TN.to(x_TK.dtype)
    groups_M, first_G, m_tiles = _tile_groups(ends_G.to(x_TK.device), tiles.m, T)
    grid = (m_tiles * -(-N // tiles.n),)
    with _on(x_TK.device):
        _kernels(_interpreting()).mm[grid](
            x_TK, w_GNK, y_TN, ends_G.to(x_TK.device, torch.int64), groups_M, first_G,
            N, K, x_TK.stride(0), x_TK.stride(1),
            w_GNK.stride(0), w_GNK.stride(1), w_GNK.stride(2), y_TN.stride(0), m_tiles,
            BLOCK_M=tiles.m, BLOCK_N=tiles.n, BLOCK_K=tiles.k, WIDEN=widen,
            num_warps=tiles.warps, num_stages=tiles.stages,
        )  # fmt: skip
    return y_TN.to(x_TK.dtype)


def _tile_groups(ends_G: Tensor, block_m: int, T: int) -> tuple[Tensor, Tensor, int]:
    """``(group of each M tile [-1: none], first M tile of each group, M tiles launched)``,
    computed on the device without a host read."""
    ends = ends_G.to(torch.int64)
    rows_G = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles_G = (rows_G + block_m - 1) // block_m
    last_G = torch.cumsum(tiles_G, 0)  # one past each group's last tile
    m_tiles = -(-T // block_m) + ends.numel()  # >= sum(tiles_G): sum ceil(r/b) <= T/b + G
    tile_M = torch.arange(m_tiles, device=ends.device)
    group_M = torch.searchsorted(last_G, tile_M, right=True)
    group_M = torch.where(group_M < ends.numel(), group_M, -1)
    return group_M, last_G - tiles_G, m_tiles


def _check(x_TK: Tensor, w_GNK: Tensor, ends_G: Tensor) -> None:
    if x_TK.dim() != 2 or w_GNK.dim() != 3 or ends_G.dim() != 1:
        raise ValueError(
            f"expected x [T, K], w [G, N, K], ends [G]; got {tuple(x_TK.shape)}, "
            f"{tuple(w_GNK.shape)}, {tuple(ends_G.shape)}"
        )
    if w_GNK.shape[2] != x_TK.shape[1] or w_GNK.shape[0] != ends_G.numel():
        raise ValueError(
            f"w {tuple(w_GNK.shape)} must be [G={ends_G.numel()}, N, K={x_TK.shape[1]}]"
        )
    if w_GNK.dtype != x_TK.dtype or w_GNK.device != x_TK.device:
        raise ValueError(f"x is {x_TK.dtype} on {x_TK.device}, w {w_GNK.dtype} on {w_GNK.device}")
    if x_TK.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be fp32, bf16 or fp16, got {x_TK.dtype}")
    if ends_G.dtype.is_floating_point or ends_G.dtype == torch.bool:
        raise ValueError(f"ends must be integers, got {ends_G.dtype}")


@functools.cache
def _kernels(interpret: bool) -> Any:
    """The jitted kernel; ``interpret`` (the ``TRITON_INTERPRET`` mode) keys the cache."""
    del interpret  # triton.jit reads TRITON_INTERPRET itself while decorating
    import triton
    import triton.language as tl

    @triton.jit
    def mm(x_ptr, w_ptr, y_ptr, ends_ptr, group_ptr, first_ptr, N, K,
           sx_t, sx_k, sw_g, sw_n, sw_k, sy_t, m_tiles,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           WIDEN: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        tile_m = pid % m_tiles  # M fastest: neighbours share the weight tile
        g = tl.load(group_ptr + tile_m)
        if g >= 0:
            start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0)
            end = tl.load(ends_ptr + g)
            row = start + (tile_m - tl.load(first_ptr + g)) * BLOCK_M + tl.arange(0, BLOCK_M)
            col = (pid // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok, col_ok = row < end, col < N
            acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)  # not tl.zeros (@jit helper)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < K
                a_ptr = x_ptr + row[:, None] * sx_t + kk[None, :] * sx_k
                a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b_ptr = w_ptr + g * sw_g + kk[:, None] * sw_k + col[None, :] * sw_n
                b = tl.load(b_ptr, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if WIDEN:  # interpreted bf16: exact fp32 by the bits (module docstring)
                    a = (a.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
                        tl.float32, bitcast=True
                    )
                    b = (b.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
                        tl.float32, bitcast=True
                    )
                acc = tl.dot(a, b, acc)
            out = y_ptr + row[:, None] * sy_t + col[None, :]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return SimpleNamespace(mm=mm)
