"""Refill staging rows shared by every layer of one shape on a device: one refill at a time.

Legend: S staging rows per rank, H hidden size, F expert FFN size.

A background refill (:mod:`moonplan.runtime.refill`) copies its experts into staging rows
and, once every rank has them, into the slots. The rows are idle between refills, and
refills are rare where popularity persists, so the layers of a model share them, as the
deployed EPLB shares its one rearrangement buffer: one :class:`StagingPool` per device,
dtype and expert shape, with ``S`` rows per projection. A layer's refill holds the pool
from its start to its commit or drop; another layer's refill waits until then (its placer
sees the pool busy and orders nothing). Every start, commit and drop happens at the same
step on every rank, and the layers run in the same order on every rank, so every rank sees
the pool held by the same layer.

Memory: ``S`` expert rows per device for all layers, instead of ``S`` per layer.
"""

from __future__ import annotations

import weakref

import torch


class StagingPool:
    """``S`` staging rows per projection, held by at most one refill at a time.

    Args:
        rows: ``{"gate_up": [S, 2F, H], "down": [S, H, F]}``.
    """

    def __init__(self, rows: dict[str, torch.Tensor]):
        self.rows = rows
        # the holder, weakly: a layer dropped without close() frees the rows with it
        self._owner: weakref.ref[object] | None = None

    @property
    def size(self) -> int:
        """``S``, the rows per projection."""
        return int(next(iter(self.rows.values())).shape[0])

    def held_by_other(self, owner: object) -> bool:
        """Whether a refill other than ``owner`` holds the rows."""
        holder = None if self._owner is None else self._owner()
        return holder is not None and holder is not owner

    def acquire(self, owner: object) -> None:
        """Hold the rows for ``owner``'s refill.

        Raises:
            RuntimeError: another refill holds them.
        """
        if self.held_by_other(owner):
            raise RuntimeError(
                "the shared refill staging rows hold another layer's refill: wait for its "
                "commit or drop (moonplan.runtime.staging)"
            )
        self._owner = weakref.ref(owner)

    def release(self, owner: object) -> None:
        """Give the rows back, if ``owner`` holds them."""
        if self._owner is not None and self._owner() is owner:
            self._owner = None


_POOLS: weakref.WeakValueDictionary[tuple[object, ...], StagingPool] = weakref.WeakValueDictionary()


def shared_pool(
    device: torch.device, dtype: torch.dtype, hidden: int, ffn: int, rows: int
) -> StagingPool:
    """The pool every layer with these shapes on ``device`` shares (made on first use,
    freed with the last store that holds it)."""
    shapes = {"gate_up": (2 * ffn, hidden), "down": (hidden, ffn)}
    key = (str(torch.device(device)), dtype, hidden, ffn, rows)
    pool = _POOLS.get(key)
    if pool is None:
        pool = StagingPool(
            {n: torch.empty((rows, *sh), dtype=dtype, device=device) for n, sh in shapes.items()}
        )
        _POOLS[key] = pool
    return pool
