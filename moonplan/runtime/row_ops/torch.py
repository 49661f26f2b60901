"""Row movement between ranks' buffers, in torch (the twins of :mod:`.triton`).

Legend:
    R ranks, S tokens of this rank, K top-k, N = S*K records (flat, token-major),
    H hidden size, ``cap_r`` rows of rank ``r``'s buffer, n rows to copy.

Every function takes a list of per-rank views (``views[r]`` is rank ``r``'s buffer:
on the shm heap a real shared-memory view of the peer's tensor, in tests any
tensors) and moves whole rows by ``(rank, row)`` addresses. The Triton kernels in
:mod:`moonplan.runtime.row_ops.triton` do the same through a table of peer base addresses
and give bit-identical results.
"""

from __future__ import annotations

import torch


def scatter_rows(
    x_SH: torch.Tensor,
    dest_rank_N: torch.Tensor,
    dest_offset_N: torch.Tensor,
    top_k: int,
    recv_views: list[torch.Tensor],
) -> None:
    """Dispatch: write ``x[n // K]`` to ``recv_views[dest_rank[n]][dest_offset[n]]``.

    Args:
        x_SH: ``[S, H]`` token rows.
        dest_rank_N: ``[N]`` integer destination rank of each record.
        dest_offset_N: ``[N]`` integer destination row of each record (all distinct
            within one rank, as :func:`moonplan.route` makes them).
        top_k: ``K``; record ``n`` belongs to token ``n // K``.
        recv_views: ``R`` tensors ``[cap_r, H]`` of ``x``'s dtype; written in place.
    """
    _check_views(recv_views, x_SH.dtype, x_SH.shape[1:])
    _check_records(dest_rank_N, dest_offset_N, x_SH.shape[0] * top_k, len(recv_views))
    token_N = torch.arange(dest_rank_N.numel(), device=x_SH.device) // max(top_k, 1)
    for r, view in enumerate(recv_views):
        n_M = (dest_rank_N == r).nonzero().flatten()
        if n_M.numel():
            view.index_copy_(0, dest_offset_N[n_M].to(view.device), x_SH[token_N[n_M]])


def gather_rows(
    src_views: list[torch.Tensor],
    src_rank_N: torch.Tensor,
    src_row_N: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """Prefetch: ``dst[i] = src_views[src_rank[i]][src_row[i]]`` (whole rows, any trailing shape).

    Args:
        src_views: ``R`` tensors ``[rows_r, ...]`` of one dtype and trailing shape.
        src_rank_N, src_row_N: ``[n]`` integer source rank and row of each copy.
        dst: ``[n, ...]`` of the views' dtype and trailing shape; written in place.
    """
    _check_views(src_views, dst.dtype, dst.shape[1:])
    _check_records(src_rank_N, src_row_N, dst.shape[0], len(src_views))
    for r, view in enumerate(src_views):
        i_M = (src_rank_N == r).nonzero().flatten()
        if i_M.numel():
            dst[i_M.to(dst.device)] = view[src_row_N[i_M].to(view.device)].to(dst.device)


def _check_views(
    views: list[torch.Tensor], dtype: torch.dtype | None, row_shape: torch.Size | None
) -> int:
    """All views share ``dtype`` and the trailing ``row_shape``; returns the row length."""
    if not views:
        if row_shape is None:
            raise ValueError("need at least one view (one per rank)")
        return int(torch.Size(row_shape).numel())
    shape = views[0].shape[1:] if row_shape is None else row_shape
    for r, v in enumerate(views):
        if v.dtype != dtype or v.shape[1:] != shape:
            raise ValueError(
                f"view of rank {r} is {v.dtype} {tuple(v.shape)}; expected {dtype} "
                f"[rows, {', '.join(map(str, shape))}]"
            )
    return int(torch.Size(shape).numel())


def _check_records(rank_N: torch.Tensor, row_N: torch.Tensor, count: int, R: int) -> None:
    """``rank`` and ``row``: integer tensors of ``count`` elements and one shape, ranks in
    ``[0, R)`` (reads the ranks on the host)."""
    check_index_shapes(rank_N, row_N, count)
    if count and (int(rank_N.min()) < 0 or int(rank_N.max()) >= R):
        raise ValueError(
            f"ranks must lie in [0, {R}), got [{int(rank_N.min())}, {int(rank_N.max())}]"
        )


def check_index_shapes(rank_N: torch.Tensor, row_N: torch.Tensor, count: int) -> None:
    """``rank`` and ``row``: integer tensors of ``count`` elements and one shape (no host read)."""
    for name, t in (("rank", rank_N), ("row", row_N)):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} indices must be integers, got {t.dtype}")
    if rank_N.shape != row_N.shape or rank_N.numel() != count:
        raise ValueError(
            f"rank {tuple(rank_N.shape)} and row {tuple(row_N.shape)} indices must have the "
            f"same shape and {count} elements"
        )
