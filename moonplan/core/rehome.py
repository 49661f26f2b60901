"""Re-homing: a running layer's home rows moved to a new home order, in place.

Legend:
    R ranks    E experts    E_r this rank's home experts (its linear block of labels)
    X          the trailing dims of one expert tensor (``[2F, H]``, ``[H, F]``, ...)
    old, new   home orders as full lists: label ``i`` is model expert ``order[i]``
               (the identity ``0 .. E-1`` where a layer has none)

A home order (:mod:`moonplan.plan.home_order`) says which experts each rank owns. A layer
takes it when it is built (``home_order=``), or later through
:meth:`ShardedExperts.rehome <moonplan.core.sharded.ShardedExperts.rehome>`, which uses
this module. Every rank computes the same moves from the old and new orders
(:func:`home_moves`). One all-to-all per tensor carries each expert's rows from its old
home rank to its new one (:func:`move_rows`). The rows are written back into the same
tensors: their shapes do not change, since every order keeps the linear map's block
sizes.

What moves with the rows (:func:`row_tensors`): each expert Parameter's data, its
``grad`` where one is held, and every optimizer state tensor of the Parameter's shape
(Adam's moments, momentum buffers). Scalar state (Adam's ``step``) stays. A state tensor
of any other shape (a factored statistic) is refused: its rows cannot be told apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moonplan.comm.group import EPGroup
from moonplan.plan.home import home_edges
from moonplan.plan.home_order import label_of


@dataclass(frozen=True)
class Moves:
    """This rank's part of a re-homing (every rank computes its own from the same orders).

    Attributes:
        send_rows: this rank's old home rows in send order (grouped by destination rank,
            then by new label).
        send_splits: rows sent to each rank (``R`` ints).
        recv_rows: this rank's new home rows in receive order (grouped by source rank,
            then by new label).
        recv_splits: rows received from each rank (``R`` ints).
        moved: experts whose home rank changes, over all ranks.
    """

    send_rows: list[int]
    send_splits: list[int]
    recv_rows: list[int]
    recv_splits: list[int]
    moved: int


def full_order(order: Sequence[int] | None, num_experts: int) -> list[int]:
    """``order`` as a list, the identity where it is ``None``."""
    return list(range(num_experts)) if order is None else list(order)


def home_moves(old: Sequence[int], new: Sequence[int], num_ranks: int, rank: int) -> Moves:
    """The :class:`Moves` of ``rank`` from home order ``old`` to ``new`` (checked
    permutations of the same ``E`` experts).

    New label ``j`` holds model expert ``m = new[j]``, whose rows sit at old label
    ``label_of(old)[m]``. Its old owner sends them to its new owner; both walk the new
    labels in ascending order, so the rows a rank sends to another arrive in the order
    that rank expects.
    """
    E = len(new)
    edges = home_edges(E, num_ranks)
    owner = [r for r in range(num_ranks) for _ in range(edges[r], edges[r + 1])]
    old_label = label_of(list(old))
    send: list[tuple[int, int, int]] = []  # (destination, new label, old row)
    recv: list[tuple[int, int, int]] = []  # (source, new label, new row)
    moved = 0
    for j, m in enumerate(new):
        i = old_label[m]
        src, dst = owner[i], owner[j]
        moved += src != dst
        if src == rank:
            send.append((dst, j, i - edges[src]))
        if dst == rank:
            recv.append((src, j, j - edges[dst]))
    send.sort()
    recv.sort()
    return Moves(
        [row for _, _, row in send],
        [sum(1 for d, _, _ in send if d == r) for r in range(num_ranks)],
        [row for _, _, row in recv],
        [sum(1 for s, _, _ in recv if s == r) for r in range(num_ranks)],
        moved,
    )


def move_rows(group: EPGroup, rows_ErX: Tensor, moves: Moves) -> Tensor:
    """Collective: this rank's new home rows ``[E_r, *X]`` (a new tensor, the dtype and
    device of ``rows_ErX``) from every rank's old ones under ``moves``."""
    dev = rows_ErX.device
    send_idx = torch.tensor(moves.send_rows, dtype=torch.int64, device=dev)
    send_NX = rows_ErX.detach().index_select(0, send_idx).contiguous()
    recv_NX = rows_ErX.new_empty((len(moves.recv_rows), *rows_ErX.shape[1:]))
    group.all_to_all(recv_NX, send_NX, moves.recv_splits, moves.send_splits)
    out_ErX = torch.empty_like(rows_ErX, memory_format=torch.contiguous_format)
    recv_idx = torch.tensor(moves.recv_rows, dtype=torch.int64, device=dev)
    out_ErX.index_copy_(0, recv_idx, recv_NX)
    return out_ErX


def row_tensors(param: nn.Parameter, optimizers: Sequence[torch.optim.Optimizer]) -> list[Tensor]:
    """The tensors whose rows follow ``param``'s experts (module docstring): its data, its
    ``grad`` if any, and each optimizer state tensor of its shape, in that order.

    Raises:
        ValueError: an optimizer holds a state tensor of ``param`` that is neither
            scalar nor of ``param``'s shape (named).
    """
    out: list[Tensor] = [param.data]
    if param.grad is not None:
        out.append(param.grad)
    for opt in optimizers:
        for key, value in sorted(opt.state.get(param, {}).items(), key=lambda kv: str(kv[0])):
            if not isinstance(value, Tensor) or value.dim() == 0:
                continue
            if value.shape != param.shape:
                raise ValueError(
                    f"optimizer state {key!r} of shape {tuple(value.shape)} beside a "
                    f"parameter of shape {tuple(param.shape)}: its rows cannot follow the "
                    "experts"
                )
            out.append(value)
    return out
