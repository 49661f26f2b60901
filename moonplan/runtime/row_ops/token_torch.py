"""Token-once dispatch and combine, local row operations in torch (the reference).

Legend:
    T rows of a token buffer (``route_rows``: one row per (token, destination) pair),
    P rows of an expert-grouped buffer (one per record, plus alignment padding),
    H hidden size, M rows of one pass of reduce_rows' loop (at most one per output row).

With token-once dispatch (``moonplan/plan/route_rows.py``) a destination receives each
token once and one int per record, the record's token-buffer row (``-1`` on alignment
padding). Locally it then needs:

* :func:`expand_rows`: ``out[p] = tokens[src_row[p]]`` (zero on padding): the
  expert-grouped rows from the token rows, and in backward a token's gradient row
  broadcast to its records.
* :func:`reduce_rows`: ``out[t] = sum_{p: dst_row[p] == t} weight[p] * rows[p]``: combine
  (weighted), dispatch-backward (unweighted) and, at the source, a token's returned rows
  summed over destinations. Each product is rounded to fp32 and added to an fp32
  accumulator that starts at ``+0.0``, in ascending ``p``: reruns are bit-identical and
  the Triton kernels (``token_triton``) give the same bits.
* :func:`row_dot`: ``out[p] = <a[p], b[idx[p]]>`` in fp32, the route-weight gradient.

:func:`segments` builds the CSR structure of ``reduce_rows`` (a stable sort by
``dst_row``, offsets) once a step; forward and backward reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

DTYPES = (torch.float32, torch.bfloat16)  # rows and weights that reduce_rows / row_dot take
DOT_BLOCK = 128  # lanes of row_dot's fixed order (the kernel's column block; a power of 2)


@dataclass(frozen=True, eq=False)
class Segments:
    """Which records each output row of :func:`reduce_rows` sums (CSR).

    Attributes:
        order_P: ``[P]`` int64 record ids sorted by ``dst_row`` (stable: ascending ``p``
            inside a row); records with ``dst_row < 0`` come first and are never read.
        offsets_T1: ``[num_out + 1]`` int64: output row ``t`` sums the records
            ``order_P[offsets[t]:offsets[t + 1]]``.
        num_out: ``T``, the output rows.
    """

    order_P: torch.Tensor
    offsets_T1: torch.Tensor
    num_out: int

    @property
    def num_rows(self) -> int:
        """``P``, the input rows (records and padding)."""
        return int(self.order_P.numel())


DstRow = Tensor | Segments  # reduce_rows' dst_row_P: the rows, or their segments
Weights = Tensor | None  # reduce_rows' optional weight_P
Dt = torch.dtype | None  # reduce_rows' optional out_dtype


def segments(dst_row_P: torch.Tensor, num_out: int, *, check: bool = True) -> Segments:
    """The CSR structure of ``dst_row_P`` for :func:`reduce_rows` (build once a step).

    Args:
        dst_row_P: ``[P]`` integer output row of each input row, ``-1`` (any negative)
            for rows to ignore.
        num_out: ``T``, the number of output rows.
        check: verify ``dst_row < num_out`` (one host read); without it a bad row is
            silently dropped here and a wild read nowhere (rows are addressed by order).

    Raises:
        ValueError: non-integer or non-1-D ``dst_row``, negative ``num_out``, a row
            ``>= num_out``.
    """
    _check_index("dst_row", dst_row_P)
    if isinstance(num_out, bool) or not isinstance(num_out, int) or num_out < 0:
        raise ValueError(f"num_out must be a non-negative int, got {num_out!r}")
    key_P = dst_row_P.to(torch.int64)
    if check:
        check_below("dst_row", key_P, num_out, "output rows")
    key_P = key_P.clamp(min=-1)
    sorted_P, order_P = torch.sort(key_P, stable=True)
    bounds_T1 = torch.arange(num_out + 1, dtype=torch.int64, device=key_P.device)
    offsets_T1 = torch.searchsorted(sorted_P, bounds_T1)
    return Segments(order_P=order_P, offsets_T1=offsets_T1, num_out=num_out)


def expand_rows(
    tokens_TH: Tensor, src_row_P: Tensor, out_PH: Tensor | None = None, *, check: bool = True
) -> Tensor:
    """``out[p] = tokens[src_row[p]]``, zero where ``src_row[p] < 0`` (bits copied).

    Args:
        tokens_TH: ``[T, H]`` rows, any dtype.
        src_row_P: ``[P]`` integer row of ``tokens`` for each output row, negative on
            padding.
        out_PH: optional ``[P, H]`` of ``tokens``' dtype and device, written in place.
        check: verify ``src_row < T`` (one host read); pass ``False`` only for rows
            already checked against these ``T`` rows (a bad row then reads out of range).

    Returns:
        ``out_PH`` (or a new ``[P, H]`` tensor).

    Raises:
        ValueError: shapes, dtypes or a ``src_row >= T``.
    """
    out_PH = check_expand(tokens_TH, src_row_P, out_PH, check=check)
    idx_P = src_row_P.to(tokens_TH.device, torch.int64)
    if tokens_TH.shape[0] == 0:  # then every row is padding (checked)
        return out_PH.zero_()
    if out_PH.is_contiguous():  # straight into out (no temporary)
        torch.index_select(tokens_TH, 0, idx_P.clamp(min=0), out=out_PH)
    else:
        out_PH.copy_(tokens_TH.index_select(0, idx_P.clamp(min=0)))
    return out_PH.index_fill_(0, (idx_P < 0).nonzero().flatten(), 0)


def reduce_rows(
    rows_PH: Tensor, dst_row_P: DstRow, num_out: int, weight_P: Weights = None, out_dtype: Dt = None
) -> Tensor:
    """``out[t] = sum_{p: dst_row[p] == t} weight[p] * rows[p]`` in ascending ``p``.

    fp32 products (``weight * row``, or the row itself) added to an fp32 accumulator
    that starts at ``+0.0``; rows with ``dst_row < 0`` ignored; an output row that no
    record hits is zero.

    Args:
        rows_PH: ``[P, H]`` fp32 or bf16.
        dst_row_P: ``[P]`` integer output row of each row (negative: ignored), or the
            :class:`Segments` of it (built once by :func:`segments`).
        num_out: ``T``.
        weight_P: optional ``[P]`` fp32 or bf16 weight of each row.
        out_dtype: dtype of the result (default: ``rows``' dtype).

    Returns:
        ``[T, H]`` in ``out_dtype``.
    """
    seg = check_reduce(rows_PH, dst_row_P, num_out, weight_P, out_dtype)
    acc_TH = torch.zeros(num_out, rows_PH.shape[1], dtype=torch.float32, device=rows_PH.device)
    len_T = seg.offsets_T1[1:] - seg.offsets_T1[:-1]
    longest = int(len_T.max()) if num_out else 0
    for j in range(longest):  # the j-th record of every segment: ascending p per row
        t_M = (len_T > j).nonzero().flatten()
        p_M = seg.order_P.index_select(0, seg.offsets_T1.index_select(0, t_M) + j)
        term_MH = rows_PH.index_select(0, p_M).float()
        if weight_P is not None:
            term_MH = weight_P.index_select(0, p_M).float()[:, None] * term_MH
        if j == 0:  # +0.0 + term, spelled out: the same bits (-0.0 becomes +0.0)
            acc_TH.index_copy_(0, t_M, term_MH + 0.0)
        else:
            acc_TH.index_add_(0, t_M, term_MH)  # distinct t_M: one add per row, exact
    return acc_TH.to(rows_PH.dtype if out_dtype is None else out_dtype)


def row_dot(a_PH: Tensor, b_TH: Tensor, idx_P: Tensor, *, check: bool = True) -> Tensor:
    """``out[p] = sum_h a[p, h] * b[idx[p], h]`` in fp32; zero where ``idx[p] < 0``.

    The order is fixed (the kernel's): lane ``j`` of ``DOT_BLOCK`` sums the products of
    columns ``j, j + DOT_BLOCK, ...`` in ascending order (each product rounded to fp32),
    then the lanes are added pairwise, halving: ``lane[j] += lane[j + width / 2]``.

    Args:
        a_PH: ``[P, H]`` fp32 or bf16 (the records' expert output rows).
        b_TH: ``[T, H]`` of ``a``'s dtype (the tokens' gradient rows).
        idx_P: ``[P]`` integer row of ``b`` for each record, negative on padding.
        check: verify ``idx < T`` (one host read), as :func:`expand_rows`' ``check``.

    Returns:
        ``[P]`` fp32.
    """
    check_dot(a_PH, b_TH, idx_P, check=check)
    P, H = a_PH.shape
    idx_P = idx_P.to(a_PH.device, torch.int64)
    lane_PB = torch.zeros(P, DOT_BLOCK, dtype=torch.float32, device=a_PH.device)
    if b_TH.shape[0] == 0:  # then every idx is negative (checked): all zero
        return lane_PB[:, 0].clone()
    b_PH = b_TH.index_select(0, idx_P.clamp(min=0))  # padding rows: masked at the end
    for lo in range(0, H, DOT_BLOCK):  # columns past H add nothing (the kernel adds +0.0)
        hi = min(H, lo + DOT_BLOCK)
        lane_PB[:, : hi - lo] += a_PH[:, lo:hi].float() * b_PH[:, lo:hi].float()
    while lane_PB.shape[1] > 1:
        half = lane_PB.shape[1] // 2
        lane_PB = lane_PB[:, :half] + lane_PB[:, half:]
    return torch.where(idx_P < 0, 0.0, lane_PB[:, 0])


# ---- checks (shared with the kernels) --------------------------------------------------------
def check_expand(
    tokens_TH: Tensor, src_row_P: Tensor, out_PH: Tensor | None, *, check: bool = True
) -> Tensor:
    """Validate :func:`expand_rows`' arguments; returns ``out_PH`` or a new one (``check``:
    also the rows' range, one host read)."""
    _check_rows("tokens", tokens_TH, None)
    _check_index("src_row", src_row_P)
    T, H = tokens_TH.shape
    P = src_row_P.numel()
    if check:
        check_below("src_row", src_row_P, T, "token rows")
    if out_PH is None:
        return torch.empty(P, H, dtype=tokens_TH.dtype, device=tokens_TH.device)
    _check_like("out", out_PH, (P, H), (tokens_TH.dtype,), tokens_TH)
    return out_PH


def check_reduce(
    rows_PH: Tensor, dst_row_P: DstRow, num_out: int, weight_P: Weights, out_dtype: Dt
) -> Segments:
    """Validate :func:`reduce_rows`' arguments; returns the segments (built if needed)."""
    _check_rows("rows", rows_PH, DTYPES)
    if out_dtype is not None and out_dtype not in DTYPES:
        raise ValueError(f"out_dtype must be torch.float32 or torch.bfloat16, got {out_dtype}")
    P = rows_PH.shape[0]
    seg = dst_row_P if isinstance(dst_row_P, Segments) else segments(dst_row_P, num_out)
    if seg.num_out != num_out or seg.num_rows != P:
        raise ValueError(
            f"segments are for {seg.num_rows} rows -> {seg.num_out}, "
            f"called with {P} rows -> {num_out}"
        )
    if seg.order_P.device != rows_PH.device:
        raise ValueError(f"dst_row is on {seg.order_P.device}, rows on {rows_PH.device}")
    if weight_P is not None:
        _check_like("weight", weight_P, (P,), DTYPES, rows_PH)
    return seg


def check_dot(a_PH: Tensor, b_TH: Tensor, idx_P: Tensor, *, check: bool = True) -> None:
    """Validate :func:`row_dot`'s arguments (``check``: also ``idx``'s range, one host read)."""
    _check_rows("a", a_PH, DTYPES)
    _check_rows("b", b_TH, (a_PH.dtype,))
    _check_index("idx", idx_P)
    if b_TH.shape[1] != a_PH.shape[1] or idx_P.numel() != a_PH.shape[0]:
        raise ValueError(
            f"a [P, H], b [T, H] and idx [P] disagree: {tuple(a_PH.shape)}, "
            f"{tuple(b_TH.shape)}, {tuple(idx_P.shape)}"
        )
    if b_TH.device != a_PH.device:
        raise ValueError(f"b is on {b_TH.device}, a on {a_PH.device}")
    if check:
        check_below("idx", idx_P, b_TH.shape[0], "rows of b")


def check_below(name: str, idx: Tensor, limit: int, what: str) -> None:
    """Raise ``ValueError`` if an entry of ``idx`` is ``>= limit`` (one host read)."""
    if idx.numel() and (top := int(idx.max())) >= limit:
        raise ValueError(f"{name} {top} is outside the {limit} {what}")


def _check_rows(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...] | None) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, H], got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")


def _check_like(
    name: str, t: Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], like: Tensor
) -> None:
    """``t`` has ``shape``, one of ``dtypes`` and ``like``'s device."""
    if t.shape != shape or t.dtype not in dtypes:
        raise ValueError(
            f"{name} must be {' or '.join(map(str, dtypes))} {list(shape)}, "
            f"got {t.dtype} {list(t.shape)}"
        )
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device}, expected {like.device}")


def _check_index(name: str, t: torch.Tensor) -> None:
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
