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

A subclass provides the two collective row movements (:meth:`_scatter`,
:meth:`_gather`) and the weight-row services of the protocol.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from moonplan.comm.group import EPGroup
from moonplan.plan.plan_type import Plan
from moonplan.plan.route import Route
from moonplan.runtime.transports.base import AfterPublish, RecvView, StepState


class RecordTransport(ABC):
    """Dispatch, combine and their backwards over a receive and an output buffer.

    Args:
        group: the EP group.
        capacity: ``C``, rows of each buffer.
        recv_CH, out_CH: this rank's receive and output rows ``[C, H]``.
    """

    name = "records"
    one_sided = False

    def __init__(self, group: EPGroup, capacity: int, recv_CH: torch.Tensor, out_CH: torch.Tensor):
        self.group, self.capacity = group, capacity
        self.recv_CH, self.out_CH = recv_CH, out_CH
        self.generation = 0

    # ---- what a subclass provides -----------------------------------------------------
    @abstractmethod
    def _scatter(
        self, x_XH: torch.Tensor, dest_N: torch.Tensor, off_N: torch.Tensor, K: int
    ) -> None:
        """Collective: row ``x[n // K]`` to row ``off[n]`` of rank ``dest[n]``'s ``recv``."""

    @abstractmethod
    def _gather(self, dest_N: torch.Tensor, off_N: torch.Tensor, publish: bool) -> torch.Tensor:
        """Collective: ``[N, H]`` row ``off[n]`` of rank ``dest[n]``'s ``out``; ``publish``
        first makes every rank's ``out`` rows visible (``False``: the caller just did)."""

    @abstractmethod
    def publish(self) -> None:
        """Collective: this rank's writes to its shared buffers become visible to peers."""

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
        return self._send(x_SH, route, plan, route.dest_rank.shape[1], StepState(x_SH.dtype))

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
        """Rows to their executing ranks (``K`` records per row of ``x``); a fresh view."""
        self.generation += 1
        self._scatter(x_XH, route.dest_rank.reshape(-1), route.dest_offset.reshape(-1), K)
        _zero_padding(self.recv_CH, plan, self.group.rank)
        size = int(plan.recv_size()[self.group.rank])
        return RecvView(self.recv_CH[:size], self.generation, self._current, state)

    def _current(self) -> int:
        return self.generation

    def _back(
        self, rows_PH: torch.Tensor, route: Route, after_publish: AfterPublish
    ) -> torch.Tensor:
        """``[S, K, H]``: each record's row of ``rows`` (written at its executing rank)."""
        self.out_CH[: rows_PH.shape[0]] = rows_PH
        if after_publish is not None:
            self.publish()
            after_publish()
        S, K = route.dest_rank.shape
        dest_N, off_N = route.dest_rank.reshape(-1), route.dest_offset.reshape(-1)
        o_NH = self._gather(dest_N, off_N, publish=after_publish is None)
        return o_NH.view(S, K, self.out_CH.shape[1])


def _zero_padding(recv_CH: torch.Tensor, plan: Plan, rank: int) -> None:
    """Zero the ``align`` padding rows between this rank's rows (experts then see zeros)."""
    if plan.align == 1:
        return
    size = int(plan.recv_size()[rank])
    pos_P = torch.arange(size, device=recv_CH.device)
    w_P = torch.searchsorted(plan.row_offset[rank], pos_P, right=True) - 1
    pad_P = pos_P - plan.row_offset[rank][w_P] >= plan.row_count[rank][w_P]
    recv_CH[:size][pad_P] = 0


def weighted_sum(
    o_SKH: torch.Tensor, weight_SK: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``y[s] = sum_k weight[s, k] * o[s, k]`` in fp32, ``k`` ascending (deterministic)."""
    acc_SH = o_SKH.new_zeros(o_SKH.shape[0], o_SKH.shape[2], dtype=torch.float32)
    w_SK = weight_SK.float()
    for k in range(o_SKH.shape[1]):
        acc_SH += w_SK[:, k, None] * o_SKH[:, k].float()
    return acc_SH.to(out_dtype)
