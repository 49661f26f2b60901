"""The row movements a transport's data path is written in: put, fetch, publish.

Legend:
    R ranks, N rows moved, X rows of a sent tensor (``N // top_k``), L row length

Both data paths (``records``: one row per ``(token, k)`` record; ``tokens``: one row
per ``(token, destination rank)``) are written once against these four methods;
the heap (peer stores and loads on a symmetric heap) and the all-to-all transport
(``torch.distributed`` collectives) each provide them once
(:mod:`~moonplan.runtime.transports.heap`, :mod:`~moonplan.runtime.transports.all_to_all`).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple, TypeVar

import torch

from moonplan.comm.group import EPGroup
from moonplan.runtime.transports.base import RecvView, SharedRows, StepState

_Moves = TypeVar("_Moves", bound="RowMoves")  # Python 3.10 has no typing.Self


class Put(NamedTuple):
    """Row ``rows[n // top_k]`` to row ``off[n]`` of rank ``dest[n]``'s ``buffer``.

    ``rows`` is ``[X, ...]`` of the buffer's dtype and row shape; ``dest`` and ``off``
    are ``[N]`` integer (``N = X * top_k``); ``buffer`` comes from ``alloc_shared``.
    """

    rows: torch.Tensor
    dest: torch.Tensor
    off: torch.Tensor
    buffer: SharedRows
    top_k: int = 1


class RowMoves(ABC):
    """Where rows live and how they move (see the module docstring); a data path built
    on it numbers its dispatches (``generation``: a receive view is valid until the next).

    Args:
        group: the EP group.
        capacity: ``C``, rows of each receive buffer.
    """

    name: str  # the registry name, set by the factory that creates it (transports.registry)

    def __init__(self, group: EPGroup, capacity: int):
        self.group, self.capacity = group, capacity
        self.generation = 0

    def _current(self) -> int:
        """The generation of the latest dispatch (a :class:`RecvView`'s clock)."""
        return self.generation

    def _view(self, rows_PH: torch.Tensor, state: StepState) -> RecvView:
        """A new dispatch's receive view of ``rows``."""
        self.generation += 1
        return RecvView(rows_PH, self.generation, self._current, state)

    def on_group(self: _Moves, group: EPGroup) -> _Moves:
        """These row movements through ``group``'s collectives: a shallow copy sharing
        every buffer, whose ``group`` is ``group`` (the same ranks in the same order,
        e.g. :meth:`~moonplan.comm.group.EPGroup.background_group`). The runtime's
        worker thread fetches weight rows through it on a collective transport; the
        data path stays on the original's group.

        Raises:
            ValueError: ``group`` has another size or puts this process at another rank.
        """
        if (group.size, group.rank) != (self.group.size, self.group.rank):
            raise ValueError(
                f"on_group needs the same ranks: rank {group.rank} of {group.size}, "
                f"not rank {self.group.rank} of {self.group.size}"
            )
        view = copy.copy(self)
        view.group = group
        return view

    @abstractmethod
    def put_rows(self, puts: Sequence[Put]) -> None:
        """Collective: every :class:`Put` lands; when it returns, every rank's buffers
        hold the rows sent to them (and no rank writes a peer's buffer before that
        peer has entered the call, so a buffer stays valid until its owner's next
        ``put_rows``)."""

    @abstractmethod
    def fetch_rows(
        self,
        buffer: SharedRows,
        src_rank_N: torch.Tensor,
        src_row_N: torch.Tensor,
        *,
        check: bool = True,
    ) -> torch.Tensor:
        """``[N, ...]``: row ``src_row[i]`` of rank ``src_rank[i]``'s ``buffer`` (as published).

        ``check=False`` skips the all-to-all transport's collective check that every
        asked row exists (the data paths' rows come from ``moonplan.route``)."""

    @abstractmethod
    def publish(self) -> None:
        """Collective: this rank's writes to its shared buffers become visible to peers."""

    @abstractmethod
    def alloc_shared(self, shape: Sequence[int], dtype: torch.dtype) -> SharedRows:
        """A buffer every rank allocates alike (same calls, same order)."""
