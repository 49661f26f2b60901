"""Receive views are zero-copy and die with the next dispatch; heap and all-to-all agree."""

from __future__ import annotations

import pytest
import torch

import moonplan
from moonplan.testing.dist import run_ranks

pytestmark = pytest.mark.distributed

H = 6


def _two_dispatches(rank: int, world: int, kind: str) -> dict:
    from moonplan.comm.group import EPGroup
    from moonplan.comm.heap_factory import create_heap
    from moonplan.runtime.transport import AllToAllTransport, HeapTransport, StaleViewError

    group = EPGroup()
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 4, (5, 2), generator=g)
    x = torch.randn(5, H, generator=g)
    counts = group.all_gather(torch.bincount(ids.reshape(-1), minlength=4))
    plan = moonplan.plan(counts, align=2)
    route = moonplan.route(plan, rank, ids)
    if kind == "heap":
        heap = create_heap(group, 1 << 16)
        transport = HeapTransport(group, heap, 64, H, torch.float32)
        first = transport.dispatch(x, route, plan)
        zero_copy = first.tensor.data_ptr() == heap_recv_ptr(transport)
    else:
        transport = AllToAllTransport(group, 64, H, torch.float32)  # type: ignore[assignment]
        first = transport.dispatch(x, route, plan)
        zero_copy = True
    rows = first.tensor.clone()
    transport.dispatch(x * 2, route, plan)
    try:
        first.tensor  # noqa: B018 - the access itself must raise
        stale = False
    except StaleViewError:
        stale = True
    return {"rows": rows, "stale": stale, "zero_copy": zero_copy}


def heap_recv_ptr(transport: object) -> int:
    return transport.buffers.recv.local.data_ptr()  # type: ignore[attr-defined]


@pytest.mark.parametrize("world", [1, 3])
def test_stale_view_raises_and_transports_agree(world: int) -> None:
    heap = run_ranks(_two_dispatches, world, "heap", timeout=60)
    a2a = run_ranks(_two_dispatches, world, "a2a", timeout=60)
    for h, a in zip(heap, a2a, strict=True):
        assert h["stale"] and a["stale"]
        assert h["zero_copy"]  # the view is the heap's receive buffer itself
        torch.testing.assert_close(h["rows"], a["rows"], rtol=0, atol=0)
