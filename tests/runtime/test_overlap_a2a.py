"""The overlapped schedule on the all-to-all transports: the worker's collectives run on
the layer's second process group, with results bit-identical to the serial schedule.

Legend: T tokens (all ranks), H hidden, F ffn, E experts, K top-k.

Each rank records every ``gather_rows`` and ``exchange_rows`` call (the all-to-all
row movements) with the thread that issued it and the process group it ran on: the
prefetch and the replica-gradient reduce must run in the worker thread on the
background group, the data path in the caller on the main group. Layers are closed
and built again (a new background group), buffers grow, and a prefetch that fails
on one rank makes every rank raise within the collective timeout.
"""

from __future__ import annotations

import threading

import pytest
import torch

from moonplan.testing.dist import RankError, run_ranks
from tests.runtime.test_overlap import assert_same_steps, make_layers, run_steps

pytestmark = pytest.mark.distributed

WORKER = "moonplan-bg_0"


def _spy_collectives(layers: dict) -> set:
    """Record ``(thread, group)`` of every all-to-all row movement from now on
    (``group``: "main", "background" or "other")."""
    from moonplan.comm import a2a

    calls: set = set()
    rt = layers[True].runtime

    def label(group) -> str:
        if group.group is rt.group.group:
            return "main"
        if rt._background is not None and group.group is rt._background.group:
            return "background"
        return "other"

    for name in ("gather_rows", "exchange_rows"):
        original = getattr(a2a, name)

        def spy(group, *args, _original=original, **kwargs):
            calls.add((threading.current_thread().name, label(group)))
            return _original(group, *args, **kwargs)

        setattr(a2a, name, spy)
    return calls


def _run(rank: int, world: int, cfg: dict) -> dict:
    import os

    import torch.distributed as dist

    if "hosts" in cfg:  # a2a-hosts: simulated hosts of this many ranks
        os.environ["LOCAL_WORLD_SIZE"] = str(cfg["hosts"])
    created: list = []  # use_local_synchronization of every new_group call
    new_group = dist.new_group

    def counting(*args, **kwargs):
        created.append(kwargs.get("use_local_synchronization"))
        return new_group(*args, **kwargs)

    dist.new_group = counting  # type: ignore[assignment]
    layers, holders = make_layers(cfg)
    calls = _spy_collectives(layers)
    rt = layers[True].runtime
    reducer_cls, reduce_threads = type(rt.reducer()), set()
    collect = reducer_cls.collect

    def spy_collect(self, *args):  # where the replica-gradient reduce's collectives run
        reduce_threads.add((threading.current_thread().name, self is rt.reducer()))
        return collect(self, *args)

    reducer_cls.collect = spy_collect  # type: ignore[method-assign]
    out = {"first": run_steps(rank, world, cfg, layers, holders)}
    out["calls"] = sorted(calls)
    out["reduce_threads"] = sorted(reduce_threads)
    out["lanes"] = (rt.lane().kind, layers[False].runtime.lane().kind)
    out["serial_background"] = layers[False].runtime._background is None
    out["capacity"] = rt.capacity
    background = rt._background
    out["distinct"] = background is not None and background.group is not rt.group.group
    for layer in layers.values():
        layer.runtime.close()
    out["closed"] = rt._background is None and rt.lane().kind == "inline"
    out["created"] = list(created)
    # built again after closing: a fresh background group, the same results
    layers, holders = make_layers(cfg)
    out["again"] = run_steps(rank, world, cfg | {"tokens": cfg["tokens"][-1:]}, layers, holders)
    for layer in layers.values():
        layer.runtime.close()
    out["created_again"] = len(created) - len(out["created"])
    return out


BASE = {"H": 8, "F": 12, "K": 2, "max_tokens": 4}  # small max_tokens: the buffers grow

CASES = [
    # world, E, slots, transport, tokens per rank per step (growth: max_tokens is small)
    (2, 4, None, "a2a", [12, 20, 9]),
    (3, 7, 1, "a2a", [9, 9, 30]),  # few slots: direct reads too
    (2, 6, 0, "a2a-records", [12, 40, 7]),
    (3, 7, 1, "a2a-records", [9, 9, 30]),
    (3, 5, 0, "a2a-records", [10, 0, 10]),  # no slots: every replica direct; an empty step
    (4, 8, 0, "a2a-hosts", [8, 8, 20]),  # two-stage: 2 simulated hosts of 2 ranks
]


@pytest.mark.parametrize(("world", "E", "slots", "transport", "sizes"), CASES)
def test_a2a_overlap_runs_on_the_background_group_bit_for_bit(
    world, E, slots, transport, sizes
) -> None:
    cfg = {"H": 8, "F": 12, "E": E, "K": 2, "slots": slots, "transport": transport}
    cfg |= {"tokens": sizes, "max_tokens": 4}
    if transport == "a2a-hosts":
        cfg["hosts"] = 2
    got = run_ranks(_run, world, cfg, timeout=120)
    assert assert_same_steps([r["first"] for r in got]) > 0  # replicas were fetched
    assert assert_same_steps([r["again"] for r in got]) > 0
    direct = sum(s["direct"] for r in got for s in r["first"][True])
    if slots is not None and slots <= 1:
        assert direct > 0  # the case reads direct rows, not only slots
    for r in got:
        assert r["lanes"] == ("thread", "inline")
        assert r["distinct"] and r["serial_background"] and r["closed"]
        assert r["capacity"] > 4 * 2  # the receive buffers grew (the store kept its group)
        # the data path in the caller on the main group; the prefetch and the reduce
        # in the worker on the background group, and nothing else anywhere
        assert r["calls"] == sorted([("MainThread", "main"), (WORKER, "background")])
        # the overlapped layer's reduce in its worker, the serial one's in the caller
        assert r["reduce_threads"] == [("MainThread", False), (WORKER, True)]
        # one group for the overlapped layer (over the whole world: every rank creates
        # it, torch's default synchronisation), destroyed at close, created again after
        assert r["created"] == [None] and r["created_again"] == 1


def _failing_prefetch(rank: int, world: int) -> str:
    """Rank 1's prefetch raises before its collectives; every rank must raise."""
    from moonplan import MoonMoE

    def hot(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(x.shape[0], 1, dtype=torch.int64)  # every record on expert 0
        return ids, torch.ones(x.shape[0], 1) + 0 * x.sum()

    layer = MoonMoE(8, 8, 4, 1, slots=2, balance="exact", router=hot, transport="a2a")
    store_cls = type(layer.runtime.store)
    original = store_cls.prefetch

    def broken(self, fetch):
        if rank == 1:
            raise ValueError("prefetch broke on rank 1")
        return original(self, fetch)

    store_cls.prefetch = broken  # type: ignore[method-assign]
    with torch.no_grad():
        layer(torch.randn(16, 8))
    return "no error"


def test_a_prefetch_failing_on_one_rank_raises_on_every_rank() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(_failing_prefetch, 2, timeout=10)
    failures = {f.rank: f for f in info.value.failures}
    assert "prefetch broke on rank 1" in failures[1].message
    # rank 0 is not left waiting past the collective timeout: it raised (its peer left
    # the collectives) or it was still running when the others had failed, and killed
    assert 0 in failures or 0 in info.value.killed


def _failing_prefetch_lingering(rank: int, world: int) -> str:
    """As :func:`_failing_prefetch`, but the failing rank stays alive (an application
    that catches the error) for twice the collective timeout before it returns."""
    import time

    try:
        return _failing_prefetch(rank, world)
    except ValueError as exc:
        time.sleep(2 * LINGER_TIMEOUT_S)
        return f"caught: {exc}"


LINGER_TIMEOUT_S = 2.0


@pytest.mark.slow  # waits for the collective timeout (about 4 s)
def test_a_peer_left_in_a_background_collective_raises_at_the_collective_timeout() -> None:
    """Rank 0's worker waits in the background group's ``gather_rows`` for rank 1, which
    never comes; it raises once the timeout of the main group (copied to the background
    group) expires, not torch's 30-minute default, and the step raises it on rank 0."""
    import time

    t0 = time.perf_counter()
    with pytest.raises(RankError) as info:
        run_ranks(_failing_prefetch_lingering, 2, timeout=LINGER_TIMEOUT_S)
    (failure,) = info.value.failures
    assert failure.rank == 0 and "gather_rows" in failure.traceback
    assert time.perf_counter() - t0 < 4 * LINGER_TIMEOUT_S + 5


def test_single_rank_needs_no_background_group(monkeypatch) -> None:
    import torch.distributed as dist

    from moonplan import MoonMoE

    def refuse(*args, **kwargs):
        raise AssertionError("the single-rank group created a process group")

    monkeypatch.setattr(dist, "new_group", refuse)
    layers = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        layers[overlap] = MoonMoE(8, 12, 4, 2, transport="a2a", overlap=overlap)
    rt = layers[True].runtime
    assert rt._background is rt.group and rt.lane().kind == "thread"
    assert layers[False].runtime._background is None
    x = torch.randn(10, 8)
    ys = [layers[o](x) for o in (True, False)]
    assert torch.equal(ys[0], ys[1])
    for layer in layers.values():
        layer.runtime.close()
    assert rt._background is None


def test_lane_kind_of_a_collective_transport() -> None:
    from moonplan.runtime.background import collectives_in_thread, lane_kind

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert collectives_in_thread(cpu) and not collectives_in_thread(cuda)
    assert lane_kind(False, cpu, True, second_group=True) == "thread"
    assert lane_kind(False, cpu, True, second_group=False) == "inline"  # no group: serial
    assert lane_kind(False, cpu, False, second_group=True) == "inline"  # serial schedule
    assert lane_kind(False, cuda, True, second_group=True) == "inline"  # NCCL: not yet


def test_on_group_needs_the_same_ranks() -> None:
    from moonplan.comm import EPGroup
    from moonplan.runtime.transports.registry import create

    g = EPGroup()
    t = create("a2a", g, capacity=4, hidden=2, dtype=torch.float32)
    view = t.on_group(g)
    assert view.group is g and view.out is t.out and view is not t  # buffers shared
    other = EPGroup()
    other.size = 2  # a group of another size (the check reads size and rank only)
    with pytest.raises(ValueError, match="same ranks"):
        t.on_group(other)


def _subgroup(rank: int, world: int, given: bool) -> dict:
    """World of 4, EP groups {0, 1} and {2, 3}; ranks 0 and 2 also hold a group of their
    own ({0, 2}), so the members of each EP group hold different numbers of groups."""
    import warnings

    import torch.distributed as dist

    from moonplan.comm.group import EPGroup

    eps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    seconds = [dist.new_group([0, 1]), dist.new_group([2, 3])] if given else [None, None]
    dist.new_group([0, 2])  # every rank calls; only 0 and 2 hold it
    group = EPGroup(eps[rank // 2], background=seconds[rank // 2])
    cfg = dict(BASE, E=4, slots=None, transport="a2a", tokens=[12, 20, 9])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layers, holders = make_layers(cfg, group)
    rt = layers[True].runtime
    out = {"lane": rt.lane().kind, "warned": any("background=" in str(w.message) for w in caught)}
    out["steps"] = run_steps(group.rank, group.size, cfg, layers, holders)
    for layer in layers.values():
        layer.runtime.close()
    return out


@pytest.mark.parametrize("given", [False, True])
def test_an_ep_subgroup_overlaps_with_a_given_background_group_and_warns_without(given) -> None:
    """EP groups smaller than the world: with ``EPGroup(group, background=...)`` the
    prefetch and reduce overlap on the caller's group; without it none is created (members
    holding different numbers of groups would name a new one differently and hang), the
    layer warns and runs them inline. Both bit-identical to serial."""
    results = run_ranks(_subgroup, 4, given, timeout=60)
    for r in results:
        assert r["lane"] == ("thread" if given else "inline") and r["warned"] == (not given)
        assert assert_same_steps([r["steps"]]) > 0


def _two_layers(rank: int, world: int) -> dict:
    """Two overlapped layers on one EPGroup share one background group."""
    import torch.distributed as dist

    from moonplan.comm.group import EPGroup

    created: list = []
    new_group = dist.new_group

    def counting(*args, **kwargs):
        created.append(1)
        return new_group(*args, **kwargs)

    dist.new_group = counting  # type: ignore[assignment]
    group = EPGroup()
    cfg = dict(BASE, E=4, slots=None, transport="a2a", tokens=[12, 20])
    first, holders = make_layers(cfg, group)
    second, holders2 = make_layers(cfg, group)
    a, b = first[True].runtime, second[True].runtime
    out = {"shared": a._background is b._background is not None, "created": len(created)}
    out["steps"] = [run_steps(rank, world, cfg, layers, h) for layers, h in
                    ((first, holders), (second, holders2))]  # fmt: skip
    for layer in first.values():
        layer.runtime.close()
    out["alive"] = b._background is not None and b._background._owned  # still held
    out["steps_after"] = run_steps(rank, world, cfg, second, holders2)
    for layer in second.values():
        layer.runtime.close()
    out["destroyed"] = group._shared is None
    return out


def test_layers_on_one_ep_group_share_one_background_group() -> None:
    for r in run_ranks(_two_layers, 2, timeout=60):
        assert r["shared"] and r["created"] == 1 and r["alive"] and r["destroyed"]
        assert all(assert_same_steps([s]) > 0 for s in (*r["steps"], r["steps_after"]))


def _declining(rank: int, world: int) -> dict:
    """A collective transport that declares it cannot move rows on a second group."""
    import warnings

    from moonplan import MoonMoE
    from moonplan.comm.group import EPGroup
    from moonplan.runtime.transports import registry
    from moonplan.runtime.transports.all_to_all import AllToAllTransport

    class Declining(AllToAllTransport):
        def on_group(self, group: EPGroup) -> None:
            return None  # the Transport protocol's answer for "cannot"

    def make(group: EPGroup, *, capacity: int, hidden: int, dtype, heap) -> Declining:
        t = Declining(group, capacity, hidden, dtype)
        t.name = "declining"
        return t

    registry.register("declining", make)
    group = EPGroup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = MoonMoE(8, 12, 4, 2, group=group, transport="declining", overlap=True)
    rt = layer.runtime
    out = {
        "warned": any("on_group returns None" in str(w.message) for w in caught),
        "background": rt._background,
        "released": group._shared is None and group._users == 0,
        "lane": rt.lane().kind,
    }
    torch.manual_seed(rank)
    layer(torch.randn(6, 8)).sum().backward()  # forward and backward run inline
    rt.close()
    return out


def test_a_transport_declining_on_group_runs_inline_and_gives_the_group_back() -> None:
    for r in run_ranks(_declining, 2, timeout=60):
        assert r == {"warned": True, "background": None, "released": True, "lane": "inline"}
