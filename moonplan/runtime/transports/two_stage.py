"""The two-stage all-to-all transport: a token once per destination host, forwarded inside it.

Legend:
    R ranks, L ranks per host (consecutive ranks), S tokens of this rank, K top-k,
    N = S*K records of this rank, H hidden, P receive rows of this rank, C capacity,
    A stage-1 rows a proxy received (one per (token, host) pair of its sources),
    B stage-2 rows an executing rank received (one per (stage-1 row, rank) pair),
    M records a proxy (``M1``) or an executing rank (``M2``) received,
    U unique pairs of a stage (``U1`` (token, host) at a source, ``U2`` (stage-1 row,
    rank) at a proxy)

Rank ``r`` sits on host ``r // L`` with local index ``r % L``. For a source ``s`` and a
host ``h`` the *proxy* is the rank of ``h`` with ``s``'s local index, ``h * L + s % L``
(on ``s``'s own host that is ``s`` itself), so stage-1 rows cross hosts and stage-2
rows stay inside one. Forward (``dispatch``):

1. stage 1 (network): the source sends ``x[token]`` once per (token, destination
   host) to that host's proxy, plus 16 bytes per record (its row among the source's
   rows for that proxy, destination rank, expert-grouped row ``dest_offset``, weight);
2. stage 2 (intra-host): the proxy sends each of its rows once per destination rank
   that executes one of its records, plus 12 bytes per record (row, offset, weight);
   the executing rank builds its expert-grouped rows with ``expand_rows``.

``combine`` runs backwards: the executing rank sums each stage-2 row's records
(``weight * o``, fp32, ascending ``k``: the order they arrive in) into one row, the
proxy sums the rows of its host's ranks for each stage-1 row (fp32, ascending rank),
one row per (token, host) goes back and the source sums over hosts (fp32, ascending
host). Partial rows travel in x's dtype: in bf16 a token whose records sit on several
ranks is rounded at each partial sum, unlike the per-record path's single rounding
(fp32 with two records per token gives the same bits: two-term sums commute; a
token whose records all run on one rank is summed exactly as there). ``dispatch_backward``
is the same without weights; ``combine_backward`` sends ``dy`` like ``dispatch`` sends
``x`` (once per host, then once per rank), the executing rank forms ``w * dy`` and
``dweight = <dy, o>`` (fp32, ``o`` kept there), and one float per record returns.

Every routing tensor a step needs later is in its :class:`StepState` (two forwards
before their backwards are independent). :attr:`TwoStageTransport.last_traffic` counts,
per operation, the rows and bytes this rank sent to other hosts (stage 1) and to
other ranks of its host (stage 2); sends to itself are local copies and not
counted. Both stages are all-to-alls of the whole group with zero rows to the
ranks a stage never addresses; weights move like the plain all-to-all transport's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from moonplan.comm import a2a
from moonplan.comm.group import EPGroup
from moonplan.plan.plan_type import Plan
from moonplan.plan.route import Route
from moonplan.runtime.row_ops import row_ops_for, token_torch
from moonplan.runtime.transports.base import AfterPublish, RecvView, SharedRows, StepState

_META1 = 4  # int32 per record in stage 1: row, destination rank, dest_offset, weight bits
_META2 = 3  # int32 per record in stage 2: row, dest_offset, weight bits
_FLOAT = 4  # bytes of one returned dweight


@dataclass(frozen=True)
class Traffic:
    """What this rank sent in one operation, by stage (rows and bytes, metadata included).

    Attributes:
        inter_rows, inter_bytes: stage 1, to ranks of other hosts (the network).
        intra_rows, intra_bytes: stage 2, to other ranks of this host.
    """

    inter_rows: int
    inter_bytes: int
    intra_rows: int
    intra_bytes: int


@dataclass
class LocalRows:
    """A shared buffer of this transport: this rank's tensor, served on request."""

    local: Tensor


def hosts_of(group_size: int, ranks_per_host: int | None) -> int:
    """``L``: ``ranks_per_host``, else ``LOCAL_WORLD_SIZE``, else one host of ``R`` ranks.

    Raises:
        ValueError: ``L`` is not a positive integer dividing ``R``.
    """
    where = "ranks_per_host"
    if ranks_per_host is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            return group_size
        where = "LOCAL_WORLD_SIZE"
        try:
            ranks_per_host = int(env)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {env!r}") from None
    if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int):
        raise ValueError(f"ranks_per_host must be an int, got {ranks_per_host!r}")
    if ranks_per_host < 1 or group_size % ranks_per_host:
        raise ValueError(
            f"{where} = {ranks_per_host} must divide the group's {group_size} ranks "
            "(hosts are groups of that many consecutive ranks; another size: register "
            "functools.partial(two_stage.factory, ranks_per_host=L) under a name of its own)"
        )
    return ranks_per_host


class TwoStageTransport:
    """Token rows once per destination host, forwarded inside it (module docstring).

    Args:
        group: the EP group.
        capacity: ``C``, receive rows of this rank.
        hidden, dtype: row width and dtype of the receive buffer.
        ranks_per_host: ``L`` (see :func:`hosts_of`).
    """

    name = "a2a-hosts"
    one_sided = False
    rounds_partial_sums = True  # partial rows travel in x's dtype (bf16: extra roundings)

    def __init__(
        self,
        group: EPGroup,
        capacity: int,
        hidden: int,
        dtype: torch.dtype,
        ranks_per_host: int | None = None,
    ):
        if capacity >= 2**31:
            raise ValueError(f"capacity {capacity} does not fit the int32 record metadata")
        self.group, self.capacity = group, capacity
        self.ranks_per_host = hosts_of(group.size, ranks_per_host)
        self.recv_CH = torch.zeros(capacity, hidden, dtype=dtype, device=group.device)
        self.generation = 0
        self.last_traffic: dict[str, Traffic] = {}
        self._ops = _token_ops(group.device)

    # ---- the data path --------------------------------------------------------------------
    def dispatch(
        self, x_SH: Tensor, route: Route, plan: Plan, *, weight_SK: Tensor | None = None
    ) -> RecvView:
        """See :class:`~moonplan.runtime.transports.base.Transport`; the weights travel with
        the records (unit weights when ``weight_SK`` is ``None``: then combine needs them)."""
        state = StepState(x_SH.dtype)
        S, K = route.dest_rank.shape
        w_SK = torch.ones(S, K) if weight_SK is None else weight_SK.detach()
        meta = self._route(route, w_SK.to(x_SH.device), state)
        state.saved["weighted"] = torch.tensor(weight_SK is not None)
        rows_BH = self._forward_rows(x_SH.detach(), state, "dispatch", meta)
        src_P = _src_rows(state, _recv_size(plan, self.group.rank))
        recv_PH = self._ops.expand_rows(rows_BH, src_P, self.recv_CH[: src_P.numel()])
        return self._to_view(recv_PH, state)

    def combine(self, y_PH: Tensor, route: Route, weight_SK: Tensor, state: StepState) -> Tensor:
        """See :class:`~moonplan.runtime.transports.base.Transport` (records summed where
        they ran, then per host, then over hosts; ``o`` stays at the executing rank)."""
        if not bool(state.saved["weighted"]):
            raise ValueError("a2a-hosts combines with the weights given to dispatch(weight_SK=)")
        y_PH = y_PH.detach()
        state.saved["o_PH"] = y_PH
        w_M = state.saved["ex_w_M"]
        return self._backward_rows(y_PH, w_M, route, state, "combine")

    def combine_backward(
        self,
        dy_SH: Tensor,
        route: Route,
        plan: Plan,
        weight_SK: Tensor,
        state: StepState,
    ) -> tuple[Tensor, Tensor]:
        """See :class:`~moonplan.runtime.transports.base.Transport`: ``dy`` once per host
        and rank; ``w * dy`` and ``dweight`` at the executing rank; one float back."""
        o_PH = state.saved.pop("o_PH")
        rows_BH = self._forward_rows(dy_SH.detach(), state, "combine_backward")
        row_M, off_M, w_M = (state.saved[k] for k in ("ex_row_M", "ex_off_M", "ex_w_M"))
        dy32_MH = rows_BH[row_M].float()
        g_PH = self.recv_CH[: _recv_size(plan, self.group.rank)]
        g_PH.zero_()
        g_PH[off_M] = (w_M[:, None] * dy32_MH).to(g_PH.dtype)
        dweight_M = (dy32_MH * o_PH[off_M].float()).sum(-1)
        dweight_N = self._floats_home(dweight_M, state)
        view = self._to_view(g_PH, state)
        return view.tensor, dweight_N.view(route.dest_rank.shape).to(weight_SK.dtype)

    def dispatch_backward(
        self,
        dx_PH: Tensor,
        route: Route,
        state: StepState,
        *,
        after_publish: AfterPublish = None,
    ) -> Tensor:
        """See :class:`~moonplan.runtime.transports.base.Transport` (a combine with unit
        weights; nothing is shared, so ``after_publish`` runs first)."""
        if after_publish is not None:
            after_publish()
        return self._backward_rows(dx_PH.detach(), None, route, state, "dispatch_backward")

    # ---- weight rows (as the plain all-to-all transport) ----------------------------------
    def alloc_shared(self, shape: Sequence[int], dtype: torch.dtype) -> LocalRows:
        """A zeroed local tensor (peers get its rows through :meth:`fetch_rows`)."""
        return LocalRows(torch.zeros(*shape, dtype=dtype, device=self.group.device))

    def fetch_rows(self, buffer: SharedRows, src_rank_N: Tensor, src_row_N: Tensor) -> Tensor:
        """Collective: ``[n, ...]`` rows of other ranks' ``buffer`` (every rank calls it)."""
        flat = buffer.local.reshape(buffer.local.shape[0], -1)
        got = a2a.gather_rows(self.group, flat, src_rank_N, src_row_N)
        return got.view(-1, *buffer.local.shape[1:])

    def publish(self) -> None:
        """Nothing to publish: all-to-alls carry the rows themselves."""

    # ---- routing (dispatch only) ----------------------------------------------------------
    def _route(self, route: Route, w_SK: Tensor, state: StepState) -> tuple[int, int]:
        """Both stages' pairs and record metadata, into ``state.saved`` (collective).

        Returns the metadata bytes this rank sent to other hosts and inside its host."""
        me, L = self.group.rank, self.ranks_per_host
        dest_N = route.dest_rank.reshape(-1).to(self.group.device)
        proxy_N = dest_N // L * L + me % L
        meta_N4 = self._source_pairs(route, proxy_N, w_SK, state)
        c1 = state.saved["counts1_R4"]
        meta_M4 = _exchange(self.group, meta_N4, c1[:, 1], c1[:, 3])
        meta_M3 = self._proxy_pairs(meta_M4, state)
        c2 = state.saved["counts2_R4"]
        got_M3 = _exchange(self.group, meta_M3, c2[:, 1], c2[:, 3])
        state.saved.update(
            ex_row_M=_row_in_blocks(c2, got_M3[:, 0]),
            ex_off_M=got_M3[:, 1].long(),
            ex_w_M=got_M3[:, 2].contiguous().view(torch.float32),
        )
        return _others(c1[:, 1], me) * _META1 * 4, _others(c2[:, 1], me) * _META2 * 4

    def _source_pairs(
        self, route: Route, proxy_N: Tensor, w_SK: Tensor, state: StepState
    ) -> Tensor:
        """Stage 1 at the source: the (token, proxy) rows (saved) and ``[N, 4]`` int32
        record metadata in send order (row among the rows for its proxy, destination
        rank, expert-grouped row, weight bits)."""
        R = self.group.size
        S, K = route.dest_rank.shape
        tok_N = torch.arange(S * K, device=proxy_N.device) // max(K, 1)
        tok_U, proxy_U, pos_U, pair_N = _pairs(proxy_N, tok_N, R, S)
        order_N = torch.sort(pair_N, stable=True).indices
        dest_N, off_N = (
            t.reshape(-1).to(proxy_N.device) for t in (route.dest_rank, route.dest_offset)
        )
        meta_N4 = torch.stack([pos_U[pair_N], dest_N, off_N, _bits(w_SK)], 1)[order_N]
        counts1 = _swap(self.group, _count(proxy_U, R), _count(proxy_N, R))
        state.saved.update(src_tok_U=tok_U, src_order_N=order_N, counts1_R4=counts1)
        return meta_N4.to(torch.int32)

    def _proxy_pairs(self, meta_M4: Tensor, state: StepState) -> Tensor:
        """Stage 2 at the proxy: the (stage-1 row, rank) rows (saved) and ``[M, 3]`` int32
        record metadata in send order (row among the rows for its rank, expert-grouped
        row, weight bits)."""
        R, c1 = self.group.size, state.saved["counts1_R4"]
        row_M = _row_in_blocks(c1, meta_M4[:, 0])
        dest_M = meta_M4[:, 1].long()
        row_U, dest_U, pos_U, pair_M = _pairs(dest_M, row_M, R, int(c1[:, 2].sum()))
        order_M = torch.sort(pair_M, stable=True).indices
        meta_M3 = torch.stack([pos_U[pair_M], meta_M4[:, 2], meta_M4[:, 3]], 1)[order_M]
        counts2 = _swap(self.group, _count(dest_U, R), _count(dest_M, R))
        state.saved.update(px_row_U=row_U, px_order_M=order_M, counts2_R4=counts2)
        return meta_M3.to(torch.int32)

    # ---- row movements --------------------------------------------------------------------
    def _forward_rows(
        self, x_SH: Tensor, state: StepState, op: str, extra: tuple[int, int] = (0, 0)
    ) -> Tensor:
        """``[B, H]``: ``x``'s rows at the executing rank, one per (token, rank) pair."""
        c1, c2 = state.saved["counts1_R4"], state.saved["counts2_R4"]
        rows_AH = _exchange(self.group, x_SH[state.saved["src_tok_U"]], c1[:, 0], c1[:, 2])
        rows_BH = _exchange(self.group, rows_AH[state.saved["px_row_U"]], c2[:, 0], c2[:, 2])
        self._note(op, c1[:, 0], c2[:, 0], _row_bytes(x_SH), extra)
        return rows_BH

    def _backward_rows(
        self,
        rows_PH: Tensor,
        w_M: Tensor | None,
        route: Route,
        state: StepState,
        op: str,
    ) -> Tensor:
        """``[S, H]``: each token's records of ``rows`` summed where they ran, per host,
        then over hosts (fp32 sums, x's dtype between the stages)."""
        c1, c2 = state.saved["counts1_R4"], state.saved["counts2_R4"]
        row_M, off_M = state.saved["ex_row_M"], state.saved["ex_off_M"]
        B, A = int(c2[:, 2].sum()), int(c1[:, 2].sum())
        part_BH = self._sum(rows_PH[off_M], row_M, B, w_M, state.dtype)
        got_UH = _exchange(self.group, part_BH, c2[:, 2], c2[:, 0])
        host_AH = self._sum(got_UH, state.saved["px_row_U"], A, None, state.dtype)
        back_UH = _exchange(self.group, host_AH, c1[:, 2], c1[:, 0])
        self._note(op, c1[:, 2], c2[:, 2], _row_bytes(rows_PH))
        S = route.dest_rank.shape[0]
        return self._sum(back_UH, state.saved["src_tok_U"], S, None, state.dtype)

    def _sum(
        self,
        rows_XH: Tensor,
        dst_X: Tensor,
        num_out: int,
        w_X: Tensor | None,
        dtype: torch.dtype,
    ) -> Tensor:
        """``reduce_rows`` (fp32 products and sums in ascending ``X``) into ``dtype``; rows
        of a dtype it does not take are widened to fp32 first (exact)."""
        if rows_XH.dtype not in token_torch.DTYPES or dtype not in token_torch.DTYPES:
            return self._ops.reduce_rows(rows_XH.float(), dst_X, num_out, w_X).to(dtype)
        return self._ops.reduce_rows(rows_XH, dst_X, num_out, w_X, out_dtype=dtype)

    def _floats_home(self, value_M: Tensor, state: StepState) -> Tensor:
        """``[N]``: one fp32 per record from its executing rank back to its source."""
        c1, c2 = state.saved["counts1_R4"], state.saved["counts2_R4"]
        at_proxy = torch.empty_like(state.saved["px_order_M"], dtype=torch.float32)
        got_M = _exchange(self.group, value_M[:, None], c2[:, 3], c2[:, 1])
        at_proxy[state.saved["px_order_M"]] = got_M[:, 0]
        got_N = _exchange(self.group, at_proxy[:, None], c1[:, 3], c1[:, 1])[:, 0]
        out_N = torch.empty_like(got_N)
        out_N[state.saved["src_order_N"]] = got_N
        me, t = self.group.rank, self.last_traffic["combine_backward"]
        self.last_traffic["combine_backward"] = Traffic(
            t.inter_rows,
            t.inter_bytes + _others(c1[:, 3], me) * _FLOAT,
            t.intra_rows,
            t.intra_bytes + _others(c2[:, 3], me) * _FLOAT,
        )
        return out_N

    # ---- views and counts -----------------------------------------------------------------
    def _to_view(self, rows_PH: Tensor, state: StepState) -> RecvView:
        self.generation += 1
        return RecvView(rows_PH, self.generation, self._current, state)

    def _current(self) -> int:
        return self.generation

    def _note(
        self,
        op: str,
        sent1_R: Tensor,
        sent2_R: Tensor,
        row_bytes: int,
        extra: tuple[int, int] = (0, 0),
    ) -> None:
        """``last_traffic[op]``: rows to other ranks per stage, ``extra`` bytes added."""
        me = self.group.rank
        inter, intra = _others(sent1_R, me), _others(sent2_R, me)
        self.last_traffic[op] = Traffic(
            inter, inter * row_bytes + extra[0], intra, intra * row_bytes + extra[1]
        )


# ---- helpers ------------------------------------------------------------------------------
def _token_ops(device: torch.device) -> ModuleType:
    """``token_triton`` where the row ops run as Triton kernels, else ``token_torch``."""
    if row_ops_for(device).__name__.endswith(".triton"):
        from moonplan.runtime.row_ops import token_triton

        return token_triton
    return token_torch


def _pairs(
    dest_M: Tensor, row_M: Tensor, num_dest: int, num_rows: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The unique ``(dest, row)`` pairs of the records, sorted by (dest, row).

    Returns:
        ``(row_U, dest_U, pos_U, pair_M)`` int64: each pair's row and destination, its
        index among the pairs of its destination, and each record's pair in ``[0, U)``.
    """
    width = max(num_rows, 1)
    key_M = dest_M * width + row_M
    mask_X = torch.zeros(num_dest * width, dtype=torch.bool, device=dest_M.device)
    mask_X[key_M] = True
    pair_M = (torch.cumsum(mask_X, 0) - 1)[key_M]
    key_U = mask_X.nonzero().flatten()
    dest_U = key_U // width
    first_U = _block_start(_count(dest_U, num_dest))[dest_U]
    pos_U = torch.arange(key_U.numel(), device=key_U.device) - first_U
    return key_U % width, dest_U, pos_U, pair_M


def _count(rank_X: Tensor, R: int) -> Tensor:
    return torch.bincount(rank_X, minlength=R)


def _block_start(count_R: Tensor) -> Tensor:
    return torch.cumsum(count_R, 0) - count_R


def _row_in_blocks(counts_R4: Tensor, pos_M: Tensor) -> Tensor:
    """``[M]`` int64: each received record's row among the received rows.

    Rows and records arrive in blocks by sender (``counts[:, 2]`` rows and ``counts[:, 3]``
    records from each); a record names its row by position ``pos`` in its sender's block.
    """
    senders_R = torch.arange(counts_R4.shape[0])
    start_M = _block_start(counts_R4[:, 2])[torch.repeat_interleave(senders_R, counts_R4[:, 3])]
    return start_M.to(pos_M.device) + pos_M.long()


def _swap(group: EPGroup, rows_R: Tensor, records_R: Tensor) -> Tensor:
    """``[R, 4]`` int64: rows and records this rank sends each rank, then receives from it."""
    send_R2 = torch.stack([rows_R, records_R], 1).to(torch.int64)
    got_R2 = torch.empty_like(send_R2)
    group.all_to_all(got_R2, send_R2, [1] * group.size, [1] * group.size)
    return torch.cat([send_R2, got_R2], 1).cpu()


def _exchange(group: EPGroup, send_XD: Tensor, send_R: Tensor, recv_R: Tensor) -> Tensor:
    """Collective: rows grouped by destination out, rows grouped by source in (raw bytes)."""
    send = send_XD.contiguous()
    width = send.shape[1] * send.element_size()
    out = torch.empty(int(recv_R.sum()), width, dtype=torch.uint8, device=send.device)
    group.all_to_all(out, send.view(torch.uint8).view(-1, width), recv_R.tolist(), send_R.tolist())
    return out.view(send.dtype).view(-1, send.shape[1])


def _bits(w_SK: Tensor) -> Tensor:
    """``[N]`` int64 holding each weight's fp32 bits (as int32 values)."""
    return w_SK.reshape(-1).float().contiguous().view(torch.int32).long()


def _others(sent_R: Tensor, me: int) -> int:
    return int(sent_R.sum()) - int(sent_R[me])


def _row_bytes(x_XH: Tensor) -> int:
    return x_XH.shape[1] * x_XH.element_size()


def _recv_size(plan: Plan, rank: int) -> int:
    return int(plan.recv_size()[rank])


def _src_rows(state: StepState, P: int) -> Tensor:
    """``[P]``: the stage-2 row of each receive row, ``-1`` on padding."""
    src_P = torch.full((P,), -1, dtype=torch.int64, device=state.saved["ex_row_M"].device)
    src_P[state.saved["ex_off_M"]] = state.saved["ex_row_M"]
    return src_P


def factory(
    group: EPGroup, *, heap: Any = None, ranks_per_host: int | None = None, **sizes: Any
) -> TwoStageTransport:
    """The registry's factory (``heap`` unused): ``ranks_per_host`` or ``LOCAL_WORLD_SIZE``."""
    return TwoStageTransport(
        group, sizes["capacity"], sizes["hidden"], sizes["dtype"], ranks_per_host
    )
