"""Every backend gives the reference plan bit for bit (random and adversarial counts)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import moonplan
from moonplan.plan.plan_fields import PlanFields
from moonplan.plan.plan_type import PLAN_TENSORS
from moonplan.plan.reference import reference_plan, to_tensors
from moonplan.plan.torch_backend import plan_torch
from moonplan.testing import check_plan, counts, counts_and_options
from tests.plan.draw import counts_like

FIELDS = PLAN_TENSORS[1:]  # every field a backend computes (counts is its input)


def _reference(c: torch.Tensor, B: int, align: int, prev: PlanFields | None) -> PlanFields:
    slots = None if prev is None else prev.slot_expert.tolist()
    flows = None if prev is None else [tuple(f) for f in prev.flow.tolist() if f[0] >= 0]
    return to_tensors(reference_plan(c.tolist(), B, align, slots, flows), torch.device("cpu"))


def _assert_same(a: PlanFields, b: PlanFields, what: str) -> None:
    for k, x, y in zip(FIELDS, a, b, strict=True):
        assert torch.equal(x, y), f"{what}: field {k} differs\n{x}\n{y}"


@given(counts_and_options())
def test_torch_backend_equals_reference(case: tuple) -> None:
    c, opts = case
    ref = moonplan.plan(c, backend="reference", **opts)
    got = moonplan.plan(c, backend="torch", **opts)
    check_plan(ref, c)
    for k in FIELDS:
        assert torch.equal(getattr(ref, k), getattr(got, k)), k


@given(st.data(), st.sampled_from(["host", "tensor"]))
def test_both_scans_equal_reference_over_a_sequence_with_previous(
    data: st.DataObject, scan: str
) -> None:
    first = data.draw(counts(min_ranks=1, max_ranks=7, max_experts=16))
    R, E = first.shape
    B = data.draw(st.integers(0, -(-E // R) + 1))
    align = data.draw(st.sampled_from([1, 4]))
    prev_ref = prev_got = None
    for step in range(3):
        c = first if step == 0 else counts_like(data, first)
        ref = _reference(c, B, align, prev_ref)
        got = plan_torch(
            c,
            B,
            align,
            None if prev_got is None else prev_got.slot_expert,
            None if prev_got is None else prev_got.flow,
            scan=scan,
        )
        _assert_same(ref, got, f"step {step} scan {scan}")
        prev_ref, prev_got = ref, got


@given(counts())
def test_plan_is_deterministic(c: torch.Tensor) -> None:
    a, b = moonplan.plan(c), moonplan.plan(c.clone())
    for k in FIELDS:
        assert torch.equal(getattr(a, k), getattr(b, k))


def test_adversarial_shapes_all_backends() -> None:
    cases = [
        torch.zeros(1, 1, dtype=torch.int64),
        torch.tensor([[5]]),
        torch.tensor([[0, 0, 1000]] * 4),  # one hot expert, E < R
        torch.tensor([[7, 0, 0, 0, 0, 0, 0]]),  # single rank
        torch.tensor([[3, 1], [0, 0], [0, 0], [0, 0], [0, 0]]),  # N < R: most targets 0
        torch.tensor([[1000] + [0] * 12, [0] * 13, [0] * 13]),  # E mod R != 0, hot
    ]
    for c in cases:
        R, E = c.shape
        for B in {b for b in (0, 1, -(-E // R), -(-E // R) + 2) if b <= E}:  # slots <= E
            ref = moonplan.plan(c, slots=B, backend="reference")
            check_plan(ref, c)
            for scan in ("host", "tensor"):
                got = plan_torch(c, B, 1, None, None, scan=scan)
                for k in FIELDS:
                    assert torch.equal(getattr(ref, k), getattr(got, k)), (c.tolist(), B, scan, k)


def test_auto_backend_on_cpu_is_torch() -> None:
    assert moonplan.plan([[1, 2], [3, 4]]).backend == "torch"
    assert moonplan.plan([[1, 2], [3, 4]], backend="reference").backend == "reference"


def test_output_shapes_depend_only_on_R_E_B() -> None:
    a = moonplan.plan(torch.zeros(3, 7, dtype=torch.int64), slots=2)
    b = moonplan.plan(torch.randint(0, 100, (3, 7)), slots=2)
    for k in FIELDS:
        assert getattr(a, k).shape == getattr(b, k).shape, k
