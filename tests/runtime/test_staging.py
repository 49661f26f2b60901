"""The refill staging rows shared by the layers (``moonplan/runtime/staging.py``).

Legend: S staging rows, H hidden, F ffn, R ranks, E experts, B slots.

Two real layers taking turns are in ``test_refill.py``; here the pool's own rules.
"""

from __future__ import annotations

import pytest
import torch

from moonplan.runtime import refill as rf
from moonplan.runtime.fetch_list import HomeRows
from moonplan.runtime.staging import shared_pool


class _Holder:
    """A refill stand-in (the pool holds its holder weakly: plain objects cannot be)."""


def test_layers_of_one_shape_share_one_pool() -> None:
    a = shared_pool(torch.device("cpu"), torch.float32, 8, 12, 1)
    b = shared_pool(torch.device("cpu"), torch.float32, 8, 12, 1)
    other = shared_pool(torch.device("cpu"), torch.float32, 8, 16, 1)
    assert a is b and a is not other
    assert a.size == 1 and tuple(a.rows["gate_up"].shape) == (1, 24, 8)
    assert tuple(a.rows["down"].shape) == (1, 8, 12)


def test_one_holder_at_a_time() -> None:
    pool = shared_pool(torch.device("cpu"), torch.float32, 4, 4, 2)
    first, second = _Holder(), _Holder()
    pool.acquire(first)
    pool.acquire(first)  # holding again is no error
    assert pool.held_by_other(second) and not pool.held_by_other(first)
    with pytest.raises(RuntimeError, match="another layer's refill"):
        pool.acquire(second)
    pool.release(second)  # not the holder: nothing happens
    assert pool.held_by_other(second)
    pool.release(first)
    pool.acquire(second)
    pool.release(second)


def test_a_holder_that_is_gone_frees_the_rows() -> None:
    """A layer dropped without ``close()`` in the middle of a refill does not hold the rows
    for ever."""
    pool = shared_pool(torch.device("cpu"), torch.float32, 4, 4, 3)
    holder = _Holder()
    pool.acquire(holder)
    assert pool.held_by_other(object())
    del holder
    assert not pool.held_by_other(object())


class _BrokenLane:
    def submit(self, fn: object, *, step: bool) -> object:
        raise RuntimeError("the lane is closed")


def test_a_refill_that_cannot_start_gives_the_rows_back() -> None:
    """A refill holds the rows only while a job does: a lane that refuses the job leaves
    them free for another layer."""
    pool = shared_pool(torch.device("cpu"), torch.float32, 4, 6, 1)
    refill = rf.Refill(0, HomeRows.of(4, 2))
    target = torch.tensor([[2, -1], [-1, -1]])
    with pytest.raises(RuntimeError, match="lane is closed"):
        refill.start(target, [(0,), ()], lambda f: 0, _BrokenLane(), pool=pool,
                     collective=True)  # fmt: skip
    assert not refill.in_flight and not pool.held_by_other(object())


def test_ordered_refills_wait_in_line_first_come_first_served() -> None:
    """The rows go to the first refill in line once nobody holds them; joining twice keeps
    one place; taking the rows leaves the line; a layer that is gone leaves it too."""
    pool = shared_pool(torch.device("cpu"), torch.float32, 4, 4, 4)
    a, b, c = _Holder(), _Holder(), _Holder()
    assert pool.turn(a) and pool.waiting() == []  # nobody holds, nobody waits
    pool.acquire(a)
    for owner in (b, c, b):
        pool.join(owner)
    assert pool.waiting() == [b, c]
    assert not pool.turn(b) and not pool.turn(c)  # a holds the rows
    pool.release(a)
    assert pool.turn(b) and not pool.turn(c) and not pool.turn(a)  # b first
    pool.acquire(b)
    assert pool.waiting() == [c] and not pool.turn(c)
    pool.release(b)
    pool.join(a)
    del c  # gone before its turn: a is next
    assert pool.waiting() == [a] and pool.turn(a)
    pool.leave(a)
    assert pool.waiting() == [] and pool.turn(b)


def test_a_layer_that_stops_asking_is_passed() -> None:
    """Each waiting layer asks once a step, in the layers' order. A layer ahead that still
    asks goes first, even where it asks after the one behind it in a step; a layer ahead
    that stopped stepping is passed once it has not asked since the other's last ask (a
    step later at most)."""
    h = _Holder()
    for stops in (False, True):
        pool = shared_pool(torch.device("cpu"), torch.float32, 4, 4, 5 + stops)
        first, second = _Holder(), _Holder()
        pool.acquire(h)
        pool.join(first)
        assert not pool.turn(first)  # step 1: first orders (it runs after second)
        pool.join(second)
        assert not pool.turn(second)  # step 2: second orders, then first asks
        assert not pool.turn(first)
        pool.release(h)  # step 3: the rows are free
        if stops:  # first asks no more: passed at second's next ask
            assert not pool.turn(second)  # step 3: first asked after second in step 2
            assert pool.turn(second)  # step 4: not since
        else:  # first asked since second's last ask: it goes first
            assert not pool.turn(second) and pool.turn(first)
        assert pool.waiting() == [first, second]
