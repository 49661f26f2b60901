"""The per-record data path both built-in transports share: one row per (token, k) record.

Legend:
    R ranks, S tokens of this rank, K top-k, N = S*K records, H hidden,
    P receive rows of this rank, C receive capacity (rows of each buffer),
    X rows of a sent ``x`` (``S`` token rows with ``K`` records each, or ``N`` record rows)

Every record ``n`` (token ``n // K``) travels to row ``route.dest_offset`` of rank
``route.dest_rank``'s receive buffer ``[C, H]``; its expert output is written at the
same row of that rank's output buffer ``[C, H]`` and read back by the source, which
keeps ``o [S, K, H]`` in the step state for the weight gradient. Combine and
dispatch-backward sum over ``k`` in fp32, ascending ``k`` (bit-identical run to run,
and the same on every transport of this family).

A subclass provides the row movements (:mod:`~moonplan.runtime.transports.moves`),
which also serve the protocol's weight rows.
"""

from __future__ import annotations

import torch

from moonplan.comm.group import EPGroup
from moonplan.plan.plan_type import Plan
from moonplan.plan.route import Route
from moonplan.runtime.transports.base import AfterPublish, RecvView, StepState
from moonplan.runtime.transports.moves import Put, RowMoves


class RecordTransport(RowMoves):
    """Dispatch, combine and their backwards over a receive and an output buffer.

    A subclass provides the row movements (:class:`~moonplan.runtime.transports.moves.RowMoves`);
    ``hidden`` and ``dtype`` are the rows' ``H`` and dtype.
    """

    rows = "records"

    def __init__(self, group: EPGroup, capacity: int, hidden: int, dtype: torch.dtype):
        super().__init__(group, capacity)
        self.recv, self.out = (self.alloc_shared((capacity, hidden), dtype) for _ in range(2))
        self.recv_CH, self.out_CH = self.recv.local, self.out.local

    # ---- the data path --------------------------------------------------------------------
    def dispatch(
        self,
        x_SH: torch.Tensor,
        route: Route,
        plan: Plan,
        *,
        weight_SK: torch.Tensor | None = None,
    ) -> RecvView:
        """See :class:`~moonplan.runtime.transports.base.Transport` (``weight_SK`` unused:
        the source weights each record's output in :meth:`combine`)."""
        state = StepState(x_SH.dtype)
        P, executed = receive_sizes(plan, self.group.rank)  # read before the puts are issued
        state.saved["pad_P"] = padding_mask(plan, self.group.rank, P)
        view = self._send(x_SH, route, plan, route.dest_rank.shape[1], state)
        N, row_bytes = route.dest_rank.numel(), x_SH.shape[1] * x_SH.element_size()
        state.traffic = {"records": N, "rows_sent": N, "bytes_sent": (N + executed) * row_bytes}
        return view

    def combine(
        self, y_PH: torch.Tensor, route: Route, weight_SK: torch.Tensor, state: StepState
    ) -> torch.Tensor:
        """See :class:`~moonplan.runtime.transports.base.Transport`; keeps ``o [S, K, H]``."""
        o_SKH = self._back(y_PH.detach(), route, None)
        state.saved["o_SKH"] = o_SKH
        return weighted_sum(o_SKH, weight_SK, state.dtype)

    def combine_backward(
        self,
        dy_SH: torch.Tensor,
        route: Route,
        plan: Plan,
        weight_SK: torch.Tensor,
        state: StepState,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :class:`~moonplan.runtime.transports.base.Transport` (a dispatch of the
        records' ``weight * dy`` rows)."""
        o_SKH = state.saved.pop("o_SKH")
        dy32_SH = dy_SH.float()
        dweight_SK = (dy32_SH[:, None, :] * o_SKH.float()).sum(-1).to(weight_SK.dtype)
        g_SKH = (weight_SK.float()[:, :, None] * dy32_SH[:, None, :]).to(o_SKH.dtype)
        g_NH = g_SKH.reshape(-1, o_SKH.shape[2])
        return self._send(g_NH, route, plan, 1, state).tensor, dweight_SK

    def dispatch_backward(
        self,
        dx_PH: torch.Tensor,
        route: Route,
        state: StepState,
        *,
        after_publish: AfterPublish = None,
    ) -> torch.Tensor:
        """See :class:`~moonplan.runtime.transports.base.Transport` (a combine with unit
        weights)."""
        o_SKH = self._back(dx_PH, route, after_publish)
        ones_SK = torch.ones(o_SKH.shape[:2], dtype=torch.float32, device=o_SKH.device)
        return weighted_sum(o_SKH, ones_SK, state.dtype)

    # ---- helpers --------------------------------------------------------------------------
    def _send(
        self, x_XH: torch.Tensor, route: Route, plan: Plan, K: int, state: StepState
    ) -> RecvView:
        """Rows to their executing ranks (``K`` records per row of ``x``); a fresh view.
        The padding mask ``state.saved["pad_P"]`` is built once a step, by dispatch before
        its puts, and kept for the backward."""
        dest_N, off_N = route.dest_rank.reshape(-1), route.dest_offset.reshape(-1)
        self.put_rows([Put(x_XH, dest_N, off_N, self.recv, K)])
        pad_P = state.saved["pad_P"]
        recv_PH = self.recv_CH[: pad_P.numel()]
        if plan.align > 1:  # with align 1 there are no padding rows to clear
            recv_PH.masked_fill_(pad_P[:, None], 0)  # no host sync (a mask index would)
        return self._view(recv_PH, state)

    def _back(
        self, rows_PH: torch.Tensor, route: Route, after_publish: AfterPublish
    ) -> torch.Tensor:
        """``[S, K, H]``: each record's row of ``rows`` (written at its executing rank)."""
        self.out_CH[: rows_PH.shape[0]] = rows_PH
        self.publish()
        if after_publish is not None:
            after_publish()
        S, K = route.dest_rank.shape
        dest_N, off_N = route.dest_rank.reshape(-1), route.dest_offset.reshape(-1)
        o_NH = self.fetch_rows(self.out, dest_N, off_N, check=False)
        return o_NH.view(S, K, self.out_CH.shape[1])


def receive_sizes(plan: Plan, rank: int) -> tuple[int, int]:
    """``(P, executed)``: ``rank``'s receive rows (padding included, ``plan.recv_size()``)
    and the records it executes (``plan.target``), in one host read: a data path reads
    them before it issues its puts, so the read does not wait for the communication."""
    P, executed = torch.stack([plan.recv_size()[rank], plan.target[rank]]).tolist()
    return int(P), int(executed)


def padding_mask(plan: Plan, rank: int, size: int) -> torch.Tensor:
    """``[P]`` bool: the ``align`` padding rows between ``rank``'s receive rows (nobody
    sends them; the experts must see zeros there); ``size``: ``P``
    (:func:`receive_sizes`)."""
    if plan.align == 1:
        return torch.zeros(size, dtype=torch.bool, device=plan.device)
    pos_P = torch.arange(size, device=plan.device)
    w_P = torch.searchsorted(plan.row_offset[rank], pos_P, right=True) - 1
    return pos_P - plan.row_offset[rank][w_P] >= plan.row_count[rank][w_P]


def weighted_sum(
    o_SKH: torch.Tensor, weight_SK: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``y[s] = sum_k weight[s, k] * o[s, k]`` in fp32, ``k`` ascending (deterministic)."""
    acc_SH = o_SKH.new_zeros(o_SKH.shape[0], o_SKH.shape[2], dtype=torch.float32)
    w_SK = weight_SK.float()
    for k in range(o_SKH.shape[1]):
        acc_SH += w_SK[:, k, None] * o_SKH[:, k].float()
    return acc_SH.to(out_dtype)
