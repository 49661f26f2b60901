"""The transport protocol: every row a MoE step moves between ranks, in both directions.

Legend:
    R ranks, S tokens of this rank, K top-k, H hidden, P receive rows of this rank
    (``plan.recv_size()[rank]``, padding included), n rows fetched by ``fetch_rows``

A step calls the four data-path operations in this order, always on every rank
(collectives), with the ``route`` and ``plan`` of the step and the
:class:`StepState` its dispatch returned:

1. ``view = dispatch(x_SH, route, plan, weight_SK=w)``: this rank's
   expert-grouped receive rows ``view.tensor [P, H]`` (padding rows zero);
   ``view.state`` is the step's state, which the transport fills and reads in the
   three calls below. ``weight_SK`` (optional, no gradient flows through it) is for
   transports that weight rows at their executing rank: they may send the weights
   with the rows; per-record transports ignore it (combine gets them again).
2. ``y_SH = combine(y_PH, route, weight_SK, state)``: the experts' outputs of the
   receive rows go back to their tokens: ``y[s] = sum_k weight[s, k] * o[s, k]``
   with fp32 products and sums in a fixed order, in x's dtype (one row per record:
   ascending ``k``; one row per token and rank: ``transports/tokens.py``).
3. ``g_PH, dweight_SK = combine_backward(dy_SH, route, plan, weight_SK, state)``:
   the gradient of each receive row (``weight * dy`` of its record, at its
   executing rank, in the receive rows' dtype) and of the weights
   (``dweight[s, k] = <dy[s], o[s, k]>`` in fp32, in weight's dtype).
4. ``dx_SH = dispatch_backward(dx_PH, route, state, after_publish=None)``: the
   receive rows' input gradients back to token order, summed over ``k`` (fp32, in
   the same fixed order as combine), in x's dtype. ``after_publish`` (optional) is called once
   every shared buffer written before the call is visible to peers and before
   the rows move back: the overlapped backward starts the replica-gradient reduce
   there.

Where a record's output or gradient is kept between forward and backward
(at the source as ``o [S, K, H]``, or at the executing rank) is the transport's
business: it keeps what it needs in ``state.saved``.

The expert store and the gradient reducer move weight rows through the same
object: ``alloc_shared`` (a buffer peers may read), ``fetch_rows`` (rows of other
ranks' buffers) and ``publish`` (make this rank's writes visible). ``one_sided``
says whether ``fetch_rows`` is plain peer reads (between two ``publish`` calls,
no collective: it may run in a background thread) or a collective; a collective one
runs in a background thread only through ``on_group`` (a view on a second process
group). Capabilities are declared here, never probed: a transport says what it cannot
do through these members' answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from moonplan.comm.group import EPGroup
from moonplan.plan.plan_type import Plan
from moonplan.plan.route import Route


class StaleViewError(RuntimeError):
    """A receive view was used after a later dispatch overwrote its buffer."""


@dataclass
class StepState:
    """What a transport keeps of one step between its forward and backward.

    ``dtype`` is x's dtype (the dtype of ``y`` and ``dx``); ``saved`` holds whatever
    the transport needs later (tensors, segments: opaque to the step function);
    ``traffic`` what the step's forward moved, filled by ``dispatch`` and ``combine``:
    ``records`` (this rank's ``(token, k)`` records), ``rows_sent`` (rows its dispatch
    sent, its own rank included: one per record, or one per ``(token, destination)``)
    and ``bytes_sent`` (bytes this rank sent in dispatch and combine: the rows, the
    per-record ints and weights of token rows, and the rows it returned as executing
    rank, its own rank included). The backward moves the same rows the other way.
    """

    dtype: torch.dtype
    saved: dict[str, Any] = field(default_factory=dict)
    traffic: dict[str, int] = field(default_factory=dict)


@dataclass
class RecvView:
    """This rank's expert-grouped receive rows of one dispatch (valid until the next)."""

    _tensor: torch.Tensor
    generation: int
    _current: Callable[[], int] = field(repr=False)
    state: StepState

    @property
    def tensor(self) -> torch.Tensor:
        """``[P, H]`` the received rows; raises :class:`StaleViewError` once stale."""
        now = self._current()
        if now != self.generation:
            raise StaleViewError(
                f"receive view of dispatch {self.generation} used after dispatch "
                f"{now} overwrote the buffer; copy it to keep it"
            )
        return self._tensor


AfterPublish = Callable[[], None] | None  # dispatch_backward's hook (see the module docstring)


class SharedRows(Protocol):
    """A buffer from :meth:`Transport.alloc_shared`: ``local`` is this rank's copy."""

    @property
    def local(self) -> torch.Tensor: ...


@runtime_checkable
class Transport(Protocol):
    """Moves every row of a MoE step between ranks (see the module docstring).

    Attributes:
        name: the registry name (``moonplan.runtime.transports.registry``).
        group: the EP group it spans.
        capacity: receive rows per rank (``P`` of any plan it serves is at most this).
        one_sided: ``fetch_rows`` reads peers without a collective.
        rows: ``"records"`` (one row per ``(token, k)`` record) or ``"tokens"`` (one row
            per ``(token, destination rank)``: the runtime then routes with affinity).
    """

    name: str
    group: EPGroup
    capacity: int
    one_sided: bool
    rows: str

    def dispatch(
        self, x_SH: Tensor, route: Route, plan: Plan, *, weight_SK: Tensor | None = None
    ) -> RecvView:
        """Collective: token rows ``x [S, H]`` to their executing ranks; this rank's rows."""
        ...

    def combine(self, y_PH: Tensor, route: Route, weight_SK: Tensor, state: StepState) -> Tensor:
        """Collective: expert outputs ``[P, H]`` back to tokens, weighted: ``y [S, H]``."""
        ...

    def combine_backward(
        self, dy_SH: Tensor, route: Route, plan: Plan, weight_SK: Tensor, state: StepState
    ) -> tuple[Tensor, Tensor]:
        """Collective: ``(g [P, H], dweight [S, K])`` from ``dy [S, H]``."""
        ...

    def dispatch_backward(
        self, dx_PH: Tensor, route: Route, state: StepState, *, after_publish: AfterPublish = None
    ) -> Tensor:
        """Collective: receive-row gradients ``[P, H]`` back to tokens, summed: ``[S, H]``."""
        ...

    def alloc_shared(self, shape: Sequence[int], dtype: torch.dtype) -> SharedRows:
        """A buffer every rank allocates alike (same calls, same order; contents unset)."""
        ...

    def fetch_rows(self, buffer: SharedRows, src_rank_N: Tensor, src_row_N: Tensor) -> Tensor:
        """``[n, ...]``: row ``src_row[i]`` of rank ``src_rank[i]``'s ``buffer`` (as published)."""
        ...

    def publish(self) -> None:
        """Collective: this rank's writes to its shared buffers become visible to peers."""
        ...

    def on_group(self, group: EPGroup) -> Transport | None:
        """A view of this transport whose ``fetch_rows`` and ``publish`` run on ``group``
        (the same ranks in the same order: the layer's background group), sharing every
        buffer; or ``None`` where it cannot (the default).

        The layer's worker thread fetches weight rows and reduces replica gradients
        through the view beside the caller's data path on a collective transport; one
        that answers ``None`` runs them inline (the serial schedule), with a warning. A
        one-sided transport is never asked. Built-ins: ``RowMoves.on_group``.
        """
        return None
