"""All-to-all row transport: the ``torch.distributed`` path where no symmetric heap spans
the group (several hosts on CPU, GPUs without NVSHMEM). Same bytes, same plan.

Legend:
    R  ranks in the group
    N  rows this rank sends (``exchange_rows``) or asks for (``gather_rows``)
    M  rows this rank receives (``exchange_rows``) or serves (``gather_rows``)
    H  row width in elements      Y  row bytes (``H * element size``)
    C  rows of the receive buffer (``exchange_rows``) or of the source (``gather_rows``)

Both functions are collective and start with one small all-to-all of ``[R, 4]``
int64 metadata (row count for each peer, status flags, row bytes, dtype code):
every rank receives every rank's status, row width and dtype, so an invalid input
on any rank raises the same :class:`ContractError` on every rank before any row
moves, at no extra collective. Rows travel as raw bytes (any dtype, bf16 included).
"""

from __future__ import annotations

import torch

from moonplan.comm.errors import ContractError
from moonplan.comm.group import EPGroup, dense

_OFFSET_BITS = 40  # sort key (rank << 40) + offset while offsets stay below 2**40
_OFF_BYTES = 8  # an int64 destination offset travels in front of each row

# status flags of one rank's input
_BAD_SHAPE = 1
_BAD_RANK = 2
_BAD_OFFSET = 4
_BAD_BUFFER = 8
_PROBLEMS = {
    _BAD_SHAPE: "bad shapes or dtypes (rows must be [N, H]; ranks and offsets [N] integers)",
    _BAD_RANK: "rank out of range [0, R)",
    _BAD_OFFSET: "negative offset",
    _BAD_BUFFER: "send rows and receive buffer differ in dtype or row width",
}
_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip


def exchange_rows(
    group: EPGroup,
    send_x: torch.Tensor,
    send_dest: torch.Tensor,
    send_offset: torch.Tensor,
    recv_out: torch.Tensor,
    *,
    check: bool = True,
) -> None:
    """Collective: write every rank's rows into their destinations' receive buffers.

    Rows are packed by ``(dest, offset)``; one all-to-all moves the counts (with the
    status), one moves the rows with their offsets; each receiver then writes
    ``recv_out[offset] = row``. Rows of ``recv_out`` that nobody targets are untouched.

    Args:
        group: the EP group; tensors live on ``group.device``.
        send_x: ``[N, H]`` rows of this rank (any dtype; ``N`` may be 0).
        send_dest: ``[N]`` int64 destination rank of each row, in ``[0, R)``.
        send_offset: ``[N]`` int64 row of the destination's ``recv_out`` (distinct per
            destination).
        recv_out: ``[C, H]`` this rank's receive buffer, same dtype and ``H`` as ``send_x``.
        check: verify after the exchange, collectively (one more small all-gather), that
            every received offset lies in ``[0, C)``. With ``check=False`` a bad offset
            raises on the receiving rank only; use it for offsets from ``moonplan.route``.

    Raises:
        ContractError: on every rank, naming the ranks with invalid inputs.
    """
    R = group.size
    status = _check_index(send_x, send_dest, send_offset, R)
    if send_x.dtype != recv_out.dtype or tuple(send_x.shape[1:]) != tuple(recv_out.shape[1:]):
        status |= _BAD_BUFFER
    counts_R, order_N = _pack_order(send_dest, send_offset, R, status == 0)
    recv_counts = _exchange_meta(group, counts_R, status, send_x, "exchange_rows")
    send_counts = counts_R.tolist()
    payload_NY = _pack(send_x[order_N], send_offset[order_N])
    got_MY = payload_NY.new_empty(sum(recv_counts), payload_NY.shape[1])
    group.all_to_all(got_MY, payload_NY, recv_counts, send_counts)
    off_M, rows_MH = _unpack(got_MY, recv_out.dtype)
    if check:
        C = recv_out.shape[0]
        bad_M = off_M >= C
        ok = not bool(bad_M.any())
        msg = "" if ok else f"received offsets {off_M[bad_M][:4].tolist()} outside [0, {C})"
        group.agree(ok, msg, what="exchange_rows")
    recv_out.index_copy_(0, off_M, rows_MH.view(off_M.numel(), *recv_out.shape[1:]))


def gather_rows(
    group: EPGroup,
    src: torch.Tensor,
    want_rank: torch.Tensor,
    want_offset: torch.Tensor,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Collective: fetch rows ``src_r[offset]`` of other ranks, in the asked order.

    Three all-to-alls: counts (with the status), requested offsets, replied rows.

    Args:
        group: the EP group; tensors live on ``group.device``.
        src: ``[C, H]`` this rank's rows that peers may ask for (same dtype and ``H``
            on every rank).
        want_rank: ``[N]`` int64 rank to fetch each row from, in ``[0, R)``.
        want_offset: ``[N]`` int64 row of that rank's ``src``.
        check: verify, collectively before replying (one small all-gather), that every
            requested row exists. With ``check=False`` a bad request raises on the
            serving rank only, and its peers then wait for the collective timeout.

    Returns:
        ``[N, H]`` rows (``src``'s dtype): row ``i`` is ``src`` of rank ``want_rank[i]`` at
        ``want_offset[i]``.

    Raises:
        ContractError: on every rank, naming the ranks with invalid inputs.
    """
    R = group.size
    status = _check_index(src, want_rank, want_offset, R)
    counts_R, order_N = _pack_order(want_rank, want_offset, R, status == 0)
    serve_counts = _exchange_meta(group, counts_R, status, src, "gather_rows")
    ask_counts = counts_R.tolist()
    asked_M = want_offset.new_empty(sum(serve_counts), dtype=torch.int64)
    group.all_to_all(asked_M, want_offset[order_N].to(torch.int64), serve_counts, ask_counts)
    C = src.shape[0]
    if check:
        bad_M = asked_M >= C
        ok = not bool(bad_M.any())
        msg = "" if ok else f"asked for rows {asked_M[bad_M][:4].tolist()} of a source of {C}"
        group.agree(ok, msg, what="gather_rows")
    reply_MY = _as_bytes(src[asked_M])
    got_NY = reply_MY.new_empty(order_N.numel(), reply_MY.shape[1])
    group.all_to_all(got_NY, reply_MY, ask_counts, serve_counts)
    out_NH = src.new_empty(order_N.numel(), *src.shape[1:])
    out_NH[order_N] = _from_bytes(got_NY, src.dtype).view(order_N.numel(), *src.shape[1:])
    return out_NH


# ---- validation and metadata -----------------------------------------------------------
def _check_index(x: torch.Tensor, rank_N: torch.Tensor, off_N: torch.Tensor, R: int) -> int:
    """Status flags of ``(x [N or C, H], rank [N], offset [N])`` (0: valid)."""
    shapes_ok = (
        x.dim() == 2
        and rank_N.dim() == 1
        and off_N.shape == rank_N.shape
        and not rank_N.dtype.is_floating_point
        and not off_N.dtype.is_floating_point
        and rank_N.dtype != torch.bool
        and off_N.dtype != torch.bool
    )
    if not shapes_ok:
        return _BAD_SHAPE
    status = 0
    if rank_N.numel():
        if int(rank_N.min()) < 0 or int(rank_N.max()) >= R:
            status |= _BAD_RANK
        if int(off_N.min()) < 0:
            status |= _BAD_OFFSET
    return status


def _pack_order(
    rank_N: torch.Tensor, off_N: torch.Tensor, R: int, valid: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``counts [R]`` rows for each rank, and ``order [N]`` sorted by ``(rank, offset)``."""
    dev = rank_N.device
    if not valid or rank_N.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return torch.zeros(R, dtype=torch.int64, device=dev), empty
    r_N, o_N = rank_N.to(torch.int64), off_N.to(torch.int64)
    if int(o_N.max()) < (1 << _OFFSET_BITS):
        order_N = torch.sort((r_N << _OFFSET_BITS) + o_N).indices
    else:
        order_N = torch.sort(r_N, stable=True).indices
    return torch.bincount(r_N, minlength=R), order_N


def _exchange_meta(
    group: EPGroup, counts_R: torch.Tensor, status: int, x: torch.Tensor, what: str
) -> list[int]:
    """All-to-all of ``[count, status, row bytes, dtype code]``; raise on any bad rank.

    Returns the rows each rank sends to this one (``[R]`` ints).
    """
    R = group.size
    row_bytes = _row_bytes(x) if x.dim() >= 1 else -1
    code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1
    meta_R4 = torch.tensor([[0, status, row_bytes, code]] * R, dtype=torch.int64)
    meta_R4[:, 0] = counts_R.cpu()
    got_R4 = _all_to_all_meta(group, meta_R4)
    _raise_on_bad_meta(got_R4, what)
    return got_R4[:, 0].tolist()


def _all_to_all_meta(group: EPGroup, meta_R4: torch.Tensor) -> torch.Tensor:
    send = meta_R4.to(group.device)
    got = torch.empty_like(send)
    group.all_to_all(got, send, [1] * group.size, [1] * group.size)
    return got.cpu()


def _raise_on_bad_meta(got_R4: torch.Tensor, what: str) -> None:
    """Every rank holds the same ``got[:, 1:]`` (each rank's own status): same decision."""
    rows = got_R4[:, 1:].tolist()
    problems = [
        f"rank {r}: " + ", ".join(text for bit, text in _PROBLEMS.items() if status & bit)
        for r, (status, _, _) in enumerate(rows)
        if status
    ]
    bad = [r for r, (status, _, _) in enumerate(rows) if status]
    widths = {(y, c) for _, y, c in rows}
    if not problems and len(widths) > 1:
        problems = [
            f"rank {r}: {y} bytes per row, {_dtype_name(c)}" for r, (_, y, c) in enumerate(rows)
        ]
        problems.insert(0, "row width or dtype differs across ranks")
        bad = list(range(len(rows)))
    if problems:
        raise ContractError(f"{what}: " + "; ".join(problems), tuple(bad))


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else "unsupported dtype"


# ---- byte packing ----------------------------------------------------------------------------
def _row_bytes(x: torch.Tensor) -> int:
    width = 1
    for s in x.shape[1:]:
        width *= s
    return width * x.element_size()


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """``[N, Y]`` uint8 view (or copy) of rows ``[N, ...]``."""
    width = 1
    for s in rows.shape[1:]:
        width *= s
    return rows.contiguous().view(rows.shape[0], width).view(torch.uint8)


def _from_bytes(b_NY: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[N, Y / element size]`` rows of ``dtype`` from raw bytes (a view when aligned)."""
    if b_NY.numel() == 0:  # no bytes: nothing to reinterpret (strides may be arbitrary)
        width = b_NY.shape[1] // torch.empty((), dtype=dtype).element_size()
        return torch.empty(b_NY.shape[0], width, dtype=dtype, device=b_NY.device)
    try:
        return b_NY.view(dtype)
    except RuntimeError:
        return dense(b_NY).view(dtype)


def _pack(rows_NH: torch.Tensor, off_N: torch.Tensor) -> torch.Tensor:
    """``[N, 8 + Y]`` uint8: each row's int64 offset, then its bytes."""
    N = rows_NH.shape[0]
    payload = torch.empty(
        N, _OFF_BYTES + _row_bytes(rows_NH), dtype=torch.uint8, device=rows_NH.device
    )
    payload[:, :_OFF_BYTES] = (
        off_N.to(torch.int64).contiguous().view(torch.uint8).view(N, _OFF_BYTES)
    )
    payload[:, _OFF_BYTES:] = _as_bytes(rows_NH)
    return payload


def _unpack(got_MY: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offset [M] int64, rows [M, H])`` from a received payload."""
    M = got_MY.shape[0]
    off_M = dense(got_MY[:, :_OFF_BYTES]).view(torch.int64).view(M)
    return off_M, _from_bytes(got_MY[:, _OFF_BYTES:], dtype)
