"""Token-once dispatch and combine, local row operations as Triton kernels.

Legend:
    T rows of a token buffer, P rows of an expert-grouped buffer (records and padding),
    H hidden size; see :mod:`moonplan.runtime.row_ops.token_torch` for the semantics.

Each launcher has the signature of its torch twin in ``token_torch`` and gives the same
bits: ``expand_rows`` copies bits; ``reduce_rows`` walks each output row's segment of
:class:`~moonplan.runtime.row_ops.token_torch.Segments` in order (one program per output
row and column block), adding fp32 products to an fp32 accumulator (a bf16 result is
cast by torch); ``row_dot`` sums ``DOT_BLOCK`` lanes over column blocks, then the lanes
pairwise, halving (the order the twin spells out). Kernels with a sum are launched
with ``enable_fp_fusion=False`` (no FMA). As in :mod:`moonplan.runtime.row_ops.triton`,
Triton is imported only when a launcher runs; CPU tensors need ``TRITON_INTERPRET=1``,
and bf16 inputs are widened by bit operations because the interpreter's bf16 -> fp32
cast mishandles subnormals. ``tests/runtime/row_ops/test_token_rows.py`` also compiles every
kernel for sm_90 on the CPU (the compiled front end is stricter than the interpreter).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from moonplan.runtime.row_ops.token_torch import (
    DOT_BLOCK,
    DstRow,
    Dt,
    Segments,
    Weights,
    check_dot,
    check_expand,
    check_reduce,
    segments,
)
from moonplan.runtime.row_ops.triton import Blocks, _interpreting, _on, available

__all__ = ["Segments", "available", "expand_rows", "reduce_rows", "row_dot", "segments"]

EXPAND = Blocks()  # expand_rows' tile: 4 rows x 1024 columns, 4 warps
# reduce_rows: one output row a program, 1024 columns: 8 per thread of 4 warps, so the
# loads and stores are 16-byte vectors (with 128 columns, 1 per thread: 2-byte loads and
# 4-byte stores in the sm_90 PTX, checked by a test)
REDUCE = Blocks(rows=1)
BLOCK_P = 16  # rows per program (row_dot)


def expand_rows(
    tokens_TH: Tensor, src_row_P: Tensor, out_PH: Tensor | None = None, *, check: bool = True
) -> Tensor:
    """Kernel twin of :func:`~moonplan.runtime.row_ops.token_torch.expand_rows`.

    ``out_PH``, if given, needs row-major rows (any row stride).
    """
    out_PH = check_expand(tokens_TH, src_row_P, out_PH, check=check)
    dev = _device(tokens_TH)
    P, H = out_PH.shape
    if P == 0 or H == 0:
        return out_PH
    if out_PH.stride(1) != 1:
        raise ValueError(f"out rows must be contiguous, got strides {out_PH.stride()}")
    tokens_TH = tokens_TH if tokens_TH.stride(1) == 1 else tokens_TH.contiguous()
    idx_P = src_row_P.to(dev, torch.int64).contiguous()
    rows, cols = EXPAND.tile(H)
    grid = (_cdiv(P, rows) * _cdiv(H, cols),)
    with _on(dev):
        _kernels(_interpreting()).expand[grid](
            tokens_TH, tokens_TH.stride(0), idx_P, out_PH, out_PH.stride(0), P, H,
            BLOCK_P=rows, BLOCK_H=cols, num_warps=EXPAND.warps,
        )  # fmt: skip
    return out_PH


def row_dot(a_PH: Tensor, b_TH: Tensor, idx_P: Tensor, *, check: bool = True) -> Tensor:
    """Kernel twin of :func:`~moonplan.runtime.row_ops.token_torch.row_dot`."""
    check_dot(a_PH, b_TH, idx_P, check=check)
    dev = _device(a_PH)
    P, H = a_PH.shape
    out_P = torch.zeros(P, dtype=torch.float32, device=dev)
    if P == 0 or H == 0:
        return out_P
    a_PH = a_PH if a_PH.stride(1) == 1 else a_PH.contiguous()
    b_TH = b_TH if b_TH.stride(1) == 1 else b_TH.contiguous()
    idx_P = idx_P.to(dev, torch.int64).contiguous()
    with _on(dev):
        _kernels(_interpreting()).dot[(_cdiv(P, BLOCK_P),)](
            a_PH, a_PH.stride(0), b_TH, b_TH.stride(0), idx_P, out_P, P, H,
            BLOCK_P=BLOCK_P, LANES=DOT_BLOCK, LOG2_LANES=DOT_BLOCK.bit_length() - 1,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out_P


def reduce_rows(
    rows_PH: Tensor, dst_row_P: DstRow, num_out: int, weight_P: Weights = None, out_dtype: Dt = None
) -> Tensor:
    """Kernel twin of :func:`~moonplan.runtime.row_ops.token_torch.reduce_rows`."""
    seg = check_reduce(rows_PH, dst_row_P, num_out, weight_P, out_dtype)
    dev = _device(rows_PH)
    H = rows_PH.shape[1]
    out_dtype = out_dtype or rows_PH.dtype
    # fp32 sums; a bf16 result is cast by torch afterwards (round-to-nearest-even, as the
    # twin; the interpreter cannot cast it exactly)
    acc_TH = torch.empty(num_out, H, dtype=torch.float32, device=dev)
    if num_out == 0 or H == 0:
        return acc_TH.to(out_dtype)
    rows_PH = rows_PH if rows_PH.stride(1) == 1 else rows_PH.contiguous()
    # Without weights the kernel never reads w_ptr (WEIGHTED is a constant).
    w_P = rows_PH.new_zeros(1, dtype=torch.float32) if weight_P is None else weight_P.contiguous()
    cols = REDUCE.tile(H)[1]
    grid = (num_out * _cdiv(H, cols),)
    with _on(dev):
        _kernels(_interpreting()).reduce[grid](
            rows_PH, rows_PH.stride(0), seg.order_P, seg.offsets_T1, w_P, acc_TH, H,
            WEIGHTED=weight_P is not None, BLOCK_H=cols, enable_fp_fusion=False,
            num_warps=REDUCE.warps,
        )  # fmt: skip
    return acc_TH.to(out_dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _device(t: torch.Tensor) -> torch.device:
    """The launch device; raises if ``t`` cannot run in the current Triton mode."""
    ok, why = available(t.device)
    if not ok:
        raise RuntimeError(f"moonplan token-row kernels cannot run: {why}")
    return t.device


# ---- kernels (built on first use, once per mode) --------------------------------------------
@functools.cache
def _kernels(interpret: bool) -> Any:
    """The jitted kernels; ``interpret`` (the ``TRITON_INTERPRET`` mode) keys the cache
    (``triton.jit`` reads ``TRITON_INTERPRET`` itself while decorating). One factory per
    kernel below, each importing triton only when called."""
    del interpret
    return SimpleNamespace(expand=_expand_kernel(), reduce=_reduce_kernel(), dot=_dot_kernel())


def _expand_kernel() -> Any:
    """``expand``: rows ``tok[idx[p]]`` into ``out[p]`` (``idx < 0``: a zero row)."""
    import triton
    import triton.language as tl

    @triton.jit
    def expand(tok_ptr, tok_stride, idx_ptr, out_ptr, out_stride, P, H,
               BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        num_hb = (H + BLOCK_H - 1) // BLOCK_H  # not tl.cdiv (row_ops/triton.py docstring)
        p = (pid // num_hb) * BLOCK_P + tl.arange(0, BLOCK_P)
        col = (pid % num_hb) * BLOCK_H + tl.arange(0, BLOCK_H)
        p_ok = p < P
        ok = p_ok[:, None] & (col < H)[None, :]
        idx = tl.load(idx_ptr + p, mask=p_ok, other=-1)
        src = tok_ptr + tl.maximum(idx, 0)[:, None] * tok_stride + col[None, :]
        row = tl.load(src, mask=ok & (idx >= 0)[:, None], other=0)
        tl.store(out_ptr + p[:, None] * out_stride + col[None, :], row, mask=ok)

    return expand


def _reduce_kernel() -> Any:
    """``reduce``: each token's segment of rows summed in order, fp32 (``WEIGHTED``: each
    row times its weight first)."""
    import triton
    import triton.language as tl

    @triton.jit
    def reduce(rows_ptr, rows_stride, order_ptr, offsets_ptr, w_ptr, out_ptr, H,
               WEIGHTED: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        num_hb = (H + BLOCK_H - 1) // BLOCK_H
        t = pid // num_hb
        col = (pid % num_hb) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = col < H
        start = tl.load(offsets_ptr + t)
        end = tl.load(offsets_ptr + t + 1)
        acc = tl.full([BLOCK_H], 0.0, tl.float32)  # not tl.zeros (a @jit helper)
        for i in range(start, end):  # the segment in order: ascending p
            p = tl.load(order_ptr + i)
            row = tl.load(rows_ptr + p * rows_stride + col, mask=ok, other=0)
            # bf16 -> fp32 by bits (exact; the interpreter's cast mishandles subnormals)
            if rows_ptr.dtype.element_ty == tl.bfloat16:
                row = (row.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
                    tl.float32, bitcast=True
                )
            if WEIGHTED:
                w = tl.load(w_ptr + p)
                if w_ptr.dtype.element_ty == tl.bfloat16:
                    w = (w.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
                        tl.float32, bitcast=True
                    )
                row = w * row
            acc += row
        tl.store(out_ptr + t * H + col, acc, mask=ok)

    return reduce


def _dot_kernel() -> Any:
    """``dot``: ``<a[p], b[idx[p]]>`` in fp32 in a fixed order (``LANES`` lanes, then halved)."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot(a_ptr, a_stride, b_ptr, b_stride, idx_ptr, out_ptr, P, H,
            BLOCK_P: tl.constexpr, LANES: tl.constexpr, LOG2_LANES: tl.constexpr):  # fmt: skip
        p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
        p_ok = p < P
        idx = tl.load(idx_ptr + p, mask=p_ok, other=-1)
        live = p_ok & (idx >= 0)
        lane = tl.full([BLOCK_P, LANES], 0.0, tl.float32)
        for c in range(0, H, LANES):  # column blocks in order
            col = c + tl.arange(0, LANES)
            ok = live[:, None] & (col < H)[None, :]
            a = tl.load(a_ptr + p[:, None] * a_stride + col[None, :], mask=ok, other=0)
            b_row = tl.maximum(idx, 0)[:, None] * b_stride + col[None, :]
            b = tl.load(b_ptr + b_row, mask=ok, other=0)
            if a_ptr.dtype.element_ty == tl.bfloat16:  # by bits, as in reduce
                a = (a.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
                b = (b.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            lane += a.to(tl.float32) * b.to(tl.float32)
        # lane j += lane j + width/2, halving (tl.split, not tl.sum: a @jit helper, and
        # its tree order is the compiler's); unrolled, so every width is a constant
        for i in tl.static_range(LOG2_LANES):
            # the width inline: an assigned name would be a tensor in the interpreter, and
            # a constexpr-annotated one cannot be reassigned when compiled
            halves = tl.reshape(lane, [BLOCK_P, 2, LANES >> (i + 1)])
            lo, hi = tl.split(tl.permute(halves, 0, 2, 1))
            lane = lo + hi
        total = tl.reshape(lane, [BLOCK_P])
        tl.store(out_ptr + p, tl.where(live, total, 0.0), mask=p_ok)

    return dot
