"""Refill staging rows shared by every layer of one shape on a device: one refill at a time.

Legend: S staging rows per rank, H hidden size, F expert FFN size.

A background refill (:mod:`moonplan.runtime.refill`) copies its experts into staging rows
and, once every rank has them, into the slots. The rows are idle between refills, and
refills are rare where popularity persists, so the layers of a model share them, as the
deployed EPLB shares its one rearrangement buffer: one :class:`StagingPool` per device,
dtype and expert shape, with ``S`` rows per projection. A layer's refill holds the pool
from its start to its commit or drop. A refill a layer's placer orders meanwhile waits in
line (:meth:`StagingPool.join`), first come first served: a waiting layer asks every step
(:meth:`StagingPool.turn`), and its refill starts at the first step where the pool is free
and no layer ahead of it still asks. A layer ahead that has not asked since the asker's
last ask has stopped stepping (a model that runs some layers only now and then), and is
passed, so it cannot hold up the others. So at most one refill of every other stepping
layer goes first. Every order, start, commit and drop happens at the same step on every
rank, and the layers run in the same order on every rank, so every rank sees the same
holder and the same line. A request by hand
(:meth:`~moonplan.runtime.layer_runtime.LayerRuntime.request_refill`) does not wait in
line: it starts where the rows are free, and is refused otherwise. The pool holds its
holder and the line weakly: a layer dropped without ``close()`` leaves them when it is
collected, which need not be at the same step on every rank, so close every layer.

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
        # the holder and the line, weakly: a layer dropped without close() leaves both
        self._owner: weakref.ref[object] | None = None
        self._line: list[weakref.ref[object]] = []
        self._tick = 0  # counts joins and asks
        self._seen: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        self._asked: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()

    @property
    def size(self) -> int:
        """``S``, the rows per projection."""
        return int(next(iter(self.rows.values())).shape[0])

    def held_by_other(self, owner: object) -> bool:
        """Whether a refill other than ``owner`` holds the rows."""
        holder = None if self._owner is None else self._owner()
        return holder is not None and holder is not owner

    def join(self, owner: object) -> None:
        """Put ``owner``'s ordered refill at the end of the line (once)."""
        if all(other is not owner for other in self.waiting()):
            self._line.append(weakref.ref(owner))
            self._tick += 1
            self._seen[owner] = self._tick
            self._asked.pop(owner, None)  # a new order: its first ask passes nobody

    def leave(self, owner: object) -> None:
        """Take ``owner`` out of the line, if it is in it."""
        self._line = [ref for ref in self._line if ref() is not None and ref() is not owner]

    def waiting(self) -> list[object]:
        """The owners in line, first first (those still alive)."""
        alive = [ref() for ref in self._line]
        return [owner for owner in alive if owner is not None]

    def turn(self, owner: object) -> bool:
        """``owner`` asks (every step it waits): whether its refill may start now. No other
        refill holds the rows, and every layer ahead of it in line has stopped asking: it
        has neither asked nor joined since ``owner``'s last ask (on ``owner``'s first ask
        nobody is known to have stopped; module docstring)."""
        last = self._asked.get(owner)
        self._tick += 1
        self._seen[owner] = self._asked[owner] = self._tick
        if self.held_by_other(owner):
            return False
        for other in self.waiting():
            if other is owner:
                return True
            if last is None or self._seen.get(other, 0) > last:  # it still asks: it goes first
                return False
        return True

    def acquire(self, owner: object) -> None:
        """Hold the rows for ``owner``'s refill (and take it out of the line).

        Raises:
            RuntimeError: another refill holds them.
        """
        if self.held_by_other(owner):
            raise RuntimeError(
                "the shared refill staging rows hold another layer's refill: wait for its "
                "commit or drop (moonplan.runtime.staging)"
            )
        self.leave(owner)
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
