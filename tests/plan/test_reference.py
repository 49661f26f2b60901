"""Hand-worked plans of the reference planner and its input errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moonplan
from moonplan import PlanError, check_plan


def _on_rank0(totals: list[int], ranks: int) -> torch.Tensor:
    counts_RE = torch.zeros(ranks, len(totals), dtype=torch.int64)
    counts_RE[0] = torch.tensor(totals)
    return counts_RE


def test_worked_example_four_ranks() -> None:
    counts_RE = _on_rank0([9, 1, 2, 0, 3, 5, 4, 8], 4)
    p = moonplan.plan(counts_RE, backend="reference")
    check_plan(p, counts_RE)
    # Static loads 10, 2, 8, 12: rank 3 fills rank 1 (6 records, overshooting by 2),
    # then rank 0 refills rank 3.
    assert p.static_load().tolist() == [10, 2, 8, 12]
    assert p.alloc.sum(0).tolist() == [8, 8, 8, 8]
    assert p.alloc.tolist() == [
        [7, 0, 0, 2],
        [1, 0, 0, 0],
        [0, 2, 0, 0],
        [0, 0, 0, 0],
        [0, 0, 3, 0],
        [0, 0, 5, 0],
        [0, 0, 0, 4],
        [0, 6, 0, 2],
    ]
    assert p.copies() == 2
    assert p.slot_expert.tolist() == [[-1, -1], [7, -1], [-1, -1], [0, -1]]
    assert p.alloc[0, 1] == 0 and p.alloc[0, 3] > 0  # expert 0 runs off its home rank


def _spill_in_rank_order(totals: list[int], ranks: int) -> list[list[int]]:
    """A minimal spill model: keep what fits at home, spill the rest in rank order."""
    E = len(totals)
    cap = sum(totals) // ranks
    home = moonplan.home_map(E, ranks).tolist()
    alloc = [[0] * ranks for _ in range(E)]
    spill = []
    for e, t in enumerate(totals):
        keep = min(t, cap - sum(alloc[x][home[e]] for x in range(E)))
        alloc[e][home[e]] = keep
        spill.append((e, t - keep))
    for e, rest in spill:
        for r in range(ranks):
            take = min(rest, cap - sum(alloc[x][r] for x in range(E)))
            alloc[e][r] += take
            rest -= take
    return alloc


def test_rank_order_spill_breaks_remote_bound_but_plan_does_not() -> None:
    C = 100
    totals = [C + C // 2, C + C // 2, 0]
    counts_RE = _on_rank0(totals, 3)
    naive = _spill_in_rank_order(totals, 3)
    assert sum(naive[e][2] > 0 for e in range(3)) == 2  # rank 2 needs two remote experts > M = 1
    p = moonplan.plan(counts_RE, backend="reference")
    check_plan(p, counts_RE)
    assert p.remote_experts().max() == 1
    bad = moonplan.plan(counts_RE, backend="reference")
    object.__setattr__(bad, "alloc", torch.tensor(naive).reshape(3, 3))
    with pytest.raises(PlanError, match="invariant 3"):
        check_plan(bad, counts_RE)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_all_zero_and_single_rank(backend: str) -> None:
    zero = torch.zeros(3, 5, dtype=torch.int64)
    p = moonplan.plan(zero, backend=backend)
    check_plan(p, zero)
    assert p.copies() == 0 and p.target.tolist() == [0, 0, 0]
    one = torch.tensor([[4, 0, 9]])
    p1 = moonplan.plan(one, backend=backend)
    check_plan(p1, one)
    assert p1.alloc.tolist() == [[4], [0], [9]] and p1.num_slots == 3


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_fewer_experts_than_ranks_hot_expert_split_over_all(backend: str) -> None:
    counts_RE = torch.tensor([[50, 1], [40, 0], [30, 2], [0, 0], [1, 0]])
    p = moonplan.plan(counts_RE, backend=backend)
    check_plan(p, counts_RE)
    assert p.max_local == 1
    assert (p.alloc[0] > 0).sum() == 5  # expert 0 (121 records) runs on every rank
    assert p.target.tolist() == [25, 25, 25, 25, 24]


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_slots_zero_marks_every_replica_direct(backend: str) -> None:
    counts_RE = _on_rank0([9, 1, 2, 0, 3, 5, 4, 8], 4)
    p = moonplan.plan(counts_RE, slots=0, backend=backend)
    check_plan(p, counts_RE)
    assert p.slot_expert.shape == (4, 0)
    assert p.direct_expert().tolist() == [[-1, -1], [7, -1], [-1, -1], [0, -1]]
    assert p.new_copies() == 0 and p.copies() == 2


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_align_pads_rows(backend: str) -> None:
    counts_RE = _on_rank0([9, 1, 2, 0, 3, 5, 4, 8], 4)
    p = moonplan.plan(counts_RE, align=4, backend=backend)
    check_plan(p, counts_RE)
    # rank 1: home experts 2 (2 records), 3 (0), slot with expert 7 (6 records)
    assert p.row_expert[1].tolist() == [2, 3, 7, -1]
    assert p.row_offset[1].tolist() == [0, 4, 4, 12, 12]


def test_inputs_accepted_as_lists_and_numpy() -> None:
    a = moonplan.plan([[1, 2], [3, 4]])
    b = moonplan.plan(np.array([[1, 2], [3, 4]], dtype=np.int32))
    assert torch.equal(a.alloc, b.alloc)


@pytest.mark.parametrize(
    ("counts", "kwargs", "message"),
    [
        ([[1, -2], [3, 4]], {}, r"non-negative: counts\[0, 1\] = -2"),
        ([[1.5, 2.0]], {}, "integer dtype"),
        ([1, 2, 3], {}, "2-D"),
        (torch.zeros(0, 3, dtype=torch.int64), {}, "at least one rank"),
        ([[1, 2], [3, 4]], {"num_ranks": 3}, "2 rows .* 3 ranks"),
        ([[1, 2]], {"slots": -1}, "slots must be an integer >= 0"),
        ([[1, 2]], {"align": 0}, "align must be an integer >= 1"),
        ([[1, 2]], {"backend": "fast"}, "unknown backend"),
        ([["a"]], {}, "could not read"),
    ],
)
def test_bad_input_raises_plan_error(counts: object, kwargs: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        moonplan.plan(counts, **kwargs)


def test_previous_of_another_shape_is_rejected() -> None:
    prev = moonplan.plan([[1, 2, 3, 4], [0, 0, 0, 0]])
    with pytest.raises(PlanError, match=r"previous plan has \(R, E, B\)"):
        moonplan.plan([[1, 2, 3, 4], [0, 0, 0, 0]], slots=1, previous=prev)
    with pytest.raises(PlanError, match="previous must be a moonplan Plan"):
        moonplan.plan([[1, 2]], previous="plan")  # type: ignore[arg-type]


def test_plan_error_is_a_value_error() -> None:
    assert issubclass(PlanError, ValueError)


def test_plan_is_immutable() -> None:
    p = moonplan.plan([[1, 2]])
    with pytest.raises(AttributeError):
        p.alloc = p.alloc  # type: ignore[misc]


def test_home_map_blocks() -> None:
    assert moonplan.home_map(8, 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert moonplan.home_map(7, 3).tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert moonplan.home_map(2, 4).tolist() == [0, 1]
    assert moonplan.home_map(5, 1).tolist() == [0] * 5
    with pytest.raises(PlanError):
        moonplan.home_map(0, 2)


@pytest.mark.parametrize("align", [1, 8])
def test_reference_fields_is_the_reference_backend_on_tensors(align: int) -> None:
    """``reference_fields`` (the GPU checks' twin) gives the reference backend's Plan fields,
    with and without a previous plan (its padding flows dropped)."""
    from moonplan.plan.reference import reference_fields
    from moonplan.traces import DriftingTrace

    trace = DriftingTrace(4, 12, 50, 2, sigma=1.5, seed=3)
    c0, c1 = trace.step(), trace.step()
    p0 = moonplan.plan(c0, slots=2, align=align, backend="reference")
    p1 = moonplan.plan(c1, slots=2, align=align, previous=p0, backend="reference")
    for p, counts, prev in ((p0, c0, None), (p1, c1, (p0.slot_expert, p0.flow))):
        fields = reference_fields(counts, 2, align, prev)
        for name, value in fields._asdict().items():
            assert torch.equal(getattr(p, name), value), name


def test_reference_fields_serves_the_bounded_builder_and_slots_without_flows() -> None:
    """The one conversion of the reference plan: ``target`` as ``reference_plan``'s (the
    reference builder of ``policy="bounded-<eps>"``), and previous slots without flows."""
    from fractions import Fraction

    from moonplan.plan.choice.targets import bounded_cap, water_fill
    from moonplan.plan.placement import static_load
    from moonplan.plan.plan_fields import PlanFields
    from moonplan.plan.reference import reference_fields, reference_plan, to_tensors
    from moonplan.traces import DriftingTrace

    trace = DriftingTrace(4, 12, 80, 2, sigma=2.0, seed=4)
    c0, c = trace.step(), trace.step()
    load = static_load(c).tolist()
    target = water_fill(load, bounded_cap(sum(load), len(load), Fraction(1, 10)))
    p = moonplan.plan(c, slots=2, policy="bounded-0.1", backend="reference")
    fields = reference_fields(c, 2, 1, target=target)
    want = to_tensors(reference_plan(c.tolist(), 2, 1, None, None, target), torch.device("cpu"))
    for name, value, ref in zip(PlanFields._fields, fields, want, strict=True):
        assert torch.equal(value, ref) and torch.equal(getattr(p, name), value), name
    slots = moonplan.plan(c0, slots=2).slot_expert
    fields = reference_fields(c, 2, 1, (slots, None))
    want = to_tensors(reference_plan(c.tolist(), 2, 1, slots.tolist()), torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(fields, want, strict=True))
