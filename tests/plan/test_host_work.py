"""The planner's per-call host work: host reads and kernels of the static and exact calls,
and the shortcuts that cut them give the same plans bit for bit.

Legend: R ranks, E experts, B slots, M = ceil(E/R); counts int64 ``[R, E]``.

The counts come from :mod:`tests.plan.host_work` (aten ops dispatched while the call runs,
host reads among them); on the CPU nothing waits, but a GPU call makes the same ops.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moonplan
from moonplan import PlanError
from moonplan.plan.from_alloc import home_layout, layout_reference
from moonplan.plan.home import home_map
from moonplan.plan.placement import static_alloc
from moonplan.plan.static import static_plan
from moonplan.plan.validate import check_options, checked_counts
from moonplan.testing import counts
from tests.plan.host_work import host_work


def _counts(R: int, E: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (R, E), generator=torch.Generator().manual_seed(seed))


def group_experts(E: int, R: int) -> torch.Tensor:
    """Reference ``ids_RM``: each rank's home experts in order (``home_map``), padded with
    ``E`` to ``M`` columns."""
    home = home_map(E, R).tolist()
    M = -(-E // R)
    rows = [[e for e in range(E) if home[e] == r] for r in range(R)]
    return torch.tensor([row + [E] * (M - len(row)) for row in rows], dtype=torch.int64)


@given(st.integers(1, 70), st.integers(1, 300))
def test_home_layout_is_the_home_map_and_its_groups(R: int, E: int) -> None:
    home_E, ids_RM = home_layout(E, R, torch.device("cpu"))
    assert torch.equal(home_E, home_map(E, R))
    assert torch.equal(ids_RM, group_experts(E, R))
    assert home_E.dtype == ids_RM.dtype == torch.int64


@given(st.data())
def test_static_plan_is_the_reference_layout_of_the_static_alloc(data: st.DataObject) -> None:
    first = data.draw(counts(max_ranks=7, max_experts=16))
    R, E = first.shape
    slots = data.draw(st.integers(0, min(-(-E // R) + 1, E)))
    align = data.draw(st.sampled_from([1, 4]))
    prev = moonplan.plan(first, slots=slots) if data.draw(st.booleans()) else None
    c = data.draw(counts(min_ranks=R, max_ranks=R, min_experts=E, max_experts=E))
    p = static_plan(c, slots=slots, align=align, previous=prev)
    prev_RB = None if prev is None else prev.slot_expert
    want = layout_reference(c, static_alloc(c), slots, align, prev_RB)
    for k, v in want._asdict().items():
        assert torch.equal(getattr(p, k), v), k
    assert torch.equal(p.counts, c)


@pytest.mark.parametrize("R, E", [(8, 256), (64, 256), (6, 16)])
def test_plan_validation_reads_the_host_once(R: int, E: int) -> None:
    c = _counts(R, E)
    prev = moonplan.plan(_counts(R, E, 1))
    w = host_work(lambda: moonplan.plan(c, previous=prev, policy="static"))
    assert w.host_reads == 1, w.reads
    w = host_work(lambda: checked_counts(c))
    assert w.host_reads == 1, w.reads


@pytest.mark.parametrize("R, E", [(8, 256), (64, 256), (6, 16)])
def test_static_plan_without_checks_reads_nothing_on_the_host(R: int, E: int) -> None:
    c = _counts(R, E)
    prev = moonplan.plan(_counts(R, E, 1))
    w = host_work(lambda: static_plan(c, previous=prev, check_input=False))
    assert w.host_reads == 0, w.reads
    w = host_work(lambda: moonplan.plan(c, previous=prev, policy="static", check_input=False))
    assert w.host_reads == 0, w.reads


@pytest.mark.parametrize("R, E, most", [(8, 256, 32), (64, 256, 32), (6, 16, 38), (7, 3, 33)])
def test_static_plan_launches_few_kernels(R: int, E: int, most: int) -> None:
    """The kernels a static plan launches today (47 at every shape before
    :func:`home_layout`): fails if the small steps grow back."""
    c = _counts(R, E)
    prev = moonplan.plan(_counts(R, E, 1))
    w = host_work(lambda: static_plan(c, previous=prev, check_input=False))
    assert w.kernels <= most, (w.kernels, w.ops)


def test_one_read_still_rejects_negative_counts_and_big_totals() -> None:
    with pytest.raises(PlanError, match=r"counts\[1, 2\] = -3"):
        checked_counts([[0, 0, 0], [0, 0, -3]])
    big = [[2**62, 2**62]]
    with pytest.raises(PlanError, match="int64 limit"):
        checked_counts(big)
    c, N = checked_counts([[2**62, 2**61]])
    assert N == 2**62 + 2**61 and c.dtype == torch.int64
    assert checked_counts([[1, 2]], check_values=False)[1] is None
    # ``total`` is used as read (no second read): with N = 5 the align limit is 65536.
    w = host_work(lambda: check_options(None, 1 << 16, 1, c, total=5))
    assert w.host_reads == 0, w.reads
    with pytest.raises(PlanError, match="align"):
        check_options(None, 1 << 20, 1, c, total=5)
    assert check_options(None, 1 << 20, 1, c) == 1  # the real N allows it


@pytest.mark.parametrize("policy", ["exact", "resident", "greedy"])
def test_check_input_costs_one_host_read_on_every_path(policy: str) -> None:
    """The builders' own reads aside (host builders on the CPU), validation adds one."""
    c = _counts(8, 64)
    prev = moonplan.plan(_counts(8, 64, 1))
    on = host_work(lambda: moonplan.plan(c, previous=prev, policy=policy, backend="torch"))
    off = host_work(
        lambda: moonplan.plan(c, previous=prev, policy=policy, backend="torch", check_input=False)
    )
    assert on.host_reads - off.host_reads == 1, (on.reads, off.reads)


def test_another_threads_reads_are_not_the_calls() -> None:
    """A worker thread reading beside the call (the placer's decision does, by design) is
    not counted; the call's own reads are."""
    import threading

    started, stop = threading.Event(), threading.Event()

    def beside() -> None:
        started.set()
        while not stop.is_set():
            torch.arange(4).tolist()
            torch.ones(2).sum().item()

    worker = threading.Thread(target=beside)
    worker.start()
    started.wait()
    try:
        w = host_work(lambda: [torch.ones(3).tolist() for _ in range(50)])
    finally:
        stop.set()
        worker.join()
    assert dict(w.reads) == {"tolist": 50}
