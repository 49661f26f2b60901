"""The token-once data path both built-in transports share: one row per (token, destination).

Legend:
    R ranks, S tokens of this rank, K top-k, N = S*K records of this rank, H hidden,
    U unique ``(token, destination rank)`` rows this rank sends (``Route.unique_token``),
    T token-buffer rows of this rank (``plan.target[rank]``), P receive rows of this rank
    (expert-grouped, padding included), C capacity (rows of each buffer)

Forward (``moonplan/plan/route_rows.py`` has the token-buffer layout):

* dispatch: a source puts ``x[unique_token]`` once per destination into that rank's
  token buffer (row ``Route.unique_offset``, a block per source) and, per record, two
  32-bit words at the record's expert-grouped row ``dest_offset`` of the
  destination's meta buffer: its token-buffer row (``Route.token_row``) and its
  routing weight (fp32 bits). The destination builds its expert-grouped rows with
  ``expand_rows`` (padding rows zero): the experts read a local buffer.
* combine: the executing rank weights each record's output and sums a token's
  records with ``reduce_rows`` (fp32 products and accumulator, ascending receive row)
  into its token-buffer rows, in x's dtype; the source reads its ``U`` rows back and
  sums them over destinations (ascending destination rank, fp32) into ``y [S, H]``.

Backward, the same in reverse: combine-backward puts ``dy`` once per (token,
destination); the executing rank expands it, forms ``w * dy`` per record (the
receive rows' gradient) and ``dweight = <dy, o>`` (``row_dot``), which the source
reads back one float per record; dispatch-backward sums a token's record gradients
on the executing rank and the source sums the returned rows over destinations.

Rounding against the per-record path (``records``): forward ``y`` and ``dx`` add the
same fp32 products in another order and round each rank's partial sum to x's dtype
before the source adds the partials: fp32 results differ by a few fp32 ulps, bf16
ones by up to one bf16 rounding per destination rank (relative ``2**-8`` of a
partial sum). ``w * dy`` is bit-identical; ``dweight`` is an fp32 dot in
``row_dot``'s fixed order. Every step's order is fixed, so reruns are bit-identical
and the heap and all-to-all variants agree bit for bit.

The step's :class:`~moonplan.runtime.row_ops.token_torch.Segments` (the executing
rank's records per token row; the source's rows per token) are built once in
dispatch and serve forward and backward (``state.saved``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moonplan.comm.group import EPGroup
from moonplan.plan.plan_type import Plan
from moonplan.plan.route import Route
from moonplan.runtime.row_ops import token_ops_for
from moonplan.runtime.transports.base import AfterPublish, RecvView, StepState
from moonplan.runtime.transports.moves import Put, RowMoves
from moonplan.runtime.transports.records import padding_mask, receive_sizes


class TokenTransport(RowMoves):
    """Token-once dispatch, combine and their backwards (see the module docstring).

    Built like :class:`~moonplan.runtime.transports.records.RecordTransport` (every
    buffer has ``C >= P >= T`` rows).
    """

    rows = "tokens"

    def __init__(self, group: EPGroup, capacity: int, hidden: int, dtype: torch.dtype):
        super().__init__(group, capacity)
        # Shared: token rows in (x, dy), reduced rows out (y, dx), per-record words
        # (token row, weight bits) and dweight; local: the expert-grouped rows.
        self.tokens, self.out = (self.alloc_shared((capacity, hidden), dtype) for _ in range(2))
        self.meta = self.alloc_shared((capacity, 2), torch.int32)
        self.dweight = self.alloc_shared((capacity, 1), torch.float32)
        self.recv_CH = torch.zeros(capacity, hidden, dtype=dtype, device=group.device)

    # ---- the data path --------------------------------------------------------------------
    def dispatch(
        self, x_SH: Tensor, route: Route, plan: Plan, *, weight_SK: Tensor | None = None
    ) -> RecvView:
        """See :class:`~moonplan.runtime.transports.base.Transport` (``weight_SK`` travels
        with the records; without it combine sends the weights)."""
        ops = token_ops_for(x_SH.device)
        rank, (S, K) = self.group.rank, route.dest_rank.shape
        state = StepState(x_SH.dtype)
        P, T = receive_sizes(plan, rank)  # read before the puts are issued
        pad_P = padding_mask(plan, rank, P)
        self._send_tokens(x_SH, route, plan, state, [self._meta_put(route, weight_SK)])
        meta_P2 = self.meta.local[:P]
        src_row_P = meta_P2[:, 0].to(torch.int64).masked_fill(pad_P, -1)
        seg_P = ops.segments(src_row_P, T, check=False)  # expand_rows below checks the rows
        state.saved.update(
            pad_P=pad_P,
            src_row_P=src_row_P,
            w_P=None if weight_SK is None else _weights(meta_P2, pad_P),
            seg_P=seg_P,
        )
        recv_PH = ops.expand_rows(self.tokens.local[:T], src_row_P, out_PH=self.recv_CH[:P])
        row_bytes = x_SH.shape[1] * x_SH.element_size()
        state.traffic = {"records": S * K, **self._traffic(route, state, row_bytes)}
        return self._view(recv_PH, state)

    def _traffic(self, route: Route, state: StepState, row: int) -> dict[str, int]:
        """This rank's ``rows_sent`` and ``bytes_sent`` of the step (``row``: bytes of one
        token row): its token rows out, its reduced rows back, one word per record."""
        S, K = route.dest_rank.shape
        returned = int((state.saved["seg_P"].offsets_T1.diff() > 0).sum())  # rows sent back
        U = route.sent_rows
        return {"rows_sent": U, "bytes_sent": (U + returned) * row + S * K * 8}

    def combine(self, y_PH: Tensor, route: Route, weight_SK: Tensor, state: StepState) -> Tensor:
        """See :class:`~moonplan.runtime.transports.base.Transport`; keeps the outputs
        ``o [P, H]`` at the executing rank."""
        saved = state.saved
        if saved["w_P"] is None:  # dispatch had no weights: send them now
            self.put_rows([self._meta_put(route, weight_SK)])
            P = saved["pad_P"].numel()
            saved["w_P"] = _weights(self.meta.local[:P], saved["pad_P"])
        o_PH = y_PH.detach()
        saved["o_PH"] = o_PH
        seg_P = saved["seg_P"]
        ops = token_ops_for(o_PH.device)
        red_TH = ops.reduce_rows(o_PH, seg_P, seg_P.num_out, saved["w_P"], state.dtype)
        return self._return(red_TH, route, state, None)

    def combine_backward(
        self, dy_SH: Tensor, route: Route, plan: Plan, weight_SK: Tensor, state: StepState
    ) -> tuple[Tensor, Tensor]:
        """See :class:`~moonplan.runtime.transports.base.Transport` (``dy`` once per
        (token, destination); ``w * dy`` and ``dweight`` at the executing rank)."""
        saved = state.saved
        o_PH, src_row_P = saved.pop("o_PH"), saved["src_row_P"]
        ops = token_ops_for(dy_SH.device)
        self._view(self.recv_CH, state)  # the forward's receive view is stale from here
        self._send_tokens(dy_SH, route, plan, state, [])
        dy_TH = self.tokens.local[: saved["seg_P"].num_out]
        # the rows were checked against these T rows by dispatch's expand_rows
        g_PH = ops.expand_rows(dy_TH, src_row_P, self.recv_CH[: src_row_P.numel()], check=False)
        w_P1 = saved["w_P"][:, None]  # padding rows: weight 0, row 0
        if g_PH.dtype == torch.float32:
            g_PH.mul_(w_P1)  # the same fp32 product, in place
        else:
            g_PH.copy_(w_P1 * g_PH.float())
        dweight_P = ops.row_dot(o_PH, dy_TH, src_row_P, check=False)
        self.dweight.local[: src_row_P.numel(), 0] = dweight_P
        self.publish()
        S, K = route.dest_rank.shape
        dest_N, off_N = route.dest_rank.reshape(-1), route.dest_offset.reshape(-1)
        dweight_SK = self.fetch_rows(self.dweight, dest_N, off_N, check=False).view(S, K)
        return g_PH, dweight_SK.to(weight_SK.dtype)

    def dispatch_backward(
        self, dx_PH: Tensor, route: Route, state: StepState, *, after_publish: AfterPublish = None
    ) -> Tensor:
        """See :class:`~moonplan.runtime.transports.base.Transport` (a token's record
        gradients summed at the executing rank, then over destinations)."""
        seg_P = state.saved["seg_P"]
        ops = token_ops_for(dx_PH.device)
        red_TH = ops.reduce_rows(dx_PH, seg_P, seg_P.num_out, None, state.dtype)
        return self._return(red_TH, route, state, after_publish)

    # ---- helpers --------------------------------------------------------------------------
    def _meta_put(self, route: Route, weight_SK: torch.Tensor | None) -> Put:
        """Each record's token-buffer row and weight (fp32 bits; 0 without weights), to
        its expert-grouped row at its executing rank."""
        row_N = route.token_row().reshape(-1).to(torch.int32)
        if weight_SK is None:
            w_N = torch.zeros(row_N.numel(), dtype=torch.float32, device=row_N.device)
        else:
            w_N = weight_SK.detach().reshape(-1).to(torch.float32)
        words_N2 = torch.stack([row_N, w_N.view(torch.int32)], 1)
        dest_N, off_N = route.dest_rank.reshape(-1), route.dest_offset.reshape(-1)
        return Put(words_N2, dest_N, off_N, self.meta)

    def _send_tokens(
        self, rows_SH: Tensor, route: Route, plan: Plan, state: StepState, extra: list[Put]
    ) -> None:
        """Collective: ``rows[unique_token]`` once per (token, destination) into the
        destinations' token buffers, with the ``extra`` puts."""
        rows = Put(rows_SH[route.unique_token], route.unique_dest, route.unique_offset, self.tokens)
        self.put_rows([rows, *extra])

    def _fetch_tokens(self, route: Route, state: StepState) -> Tensor:
        """Collective: every rank's published ``out`` rows back to their sources, summed
        over destinations (ascending rank, fp32): ``[S, H]`` in x's dtype."""
        got_UH = self.fetch_rows(self.out, route.unique_dest, route.unique_offset, check=False)
        S = route.dest_rank.shape[0]
        ops = token_ops_for(got_UH.device)
        seg_U = state.saved.get("seg_U") or ops.segments(route.unique_token, S, check=False)
        state.saved["seg_U"] = seg_U  # built once a step, also serves the backward
        return ops.reduce_rows(got_UH, seg_U, S, None, state.dtype)

    def _return(
        self, red_TH: torch.Tensor, route: Route, state: StepState, after_publish: AfterPublish
    ) -> torch.Tensor:
        """This rank's reduced token rows back to their sources (see :meth:`_fetch_tokens`)."""
        self.out.local[: red_TH.shape[0]] = red_TH
        self.publish()
        if after_publish is not None:
            after_publish()
        return self._fetch_tokens(route, state)


def _weights(meta_P2: torch.Tensor, pad_P: torch.Tensor) -> torch.Tensor:
    """``[P]`` fp32: the records' weights from their meta words (0 on padding rows)."""
    return meta_P2[:, 1].contiguous().view(torch.float32).masked_fill(pad_P, 0.0)
