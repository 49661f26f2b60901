"""``PlanFields``: the typed layout tensors every builder returns and ``make_plan`` consumes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moonplan
from moonplan.plan.from_alloc import layout_reference, layout_torch
from moonplan.plan.plan_fields import PlanFields, no_flows, padded_flows
from moonplan.plan.plan_type import PLAN_TENSORS, Plan, make_plan
from moonplan.plan.reference import reference_fields
from moonplan.plan.torch_backend import plan_torch


def test_the_fields_are_the_plans_tensors_after_counts() -> None:
    tensors = [f.name for f in dataclasses.fields(Plan) if f.type in ("torch.Tensor", torch.Tensor)]
    assert tensors == ["counts", *PlanFields._fields]
    assert PLAN_TENSORS == ("counts", *PlanFields._fields)


@pytest.mark.parametrize("R", [1, 2, 5])
def test_padded_flows_and_no_flows(R: int) -> None:
    flows = [(0, 1, 7)] if R > 1 else []
    got = padded_flows(flows, R)
    assert got.dtype == torch.int64 and got.shape == (max(R - 1, 0), 3)
    assert got.tolist() == [list(f) for f in flows] + [[-1, -1, 0]] * (max(R - 1, 0) - len(flows))
    none = no_flows(R, torch.device("cpu"))
    assert torch.equal(none, padded_flows([], R))


def test_every_builder_returns_plan_fields_that_make_the_same_plan() -> None:
    c = torch.tensor([[5, 0, 3, 1], [0, 9, 2, 0], [4, 4, 0, 6]])
    want = moonplan.plan(c, slots=2, backend="reference")
    built = {
        "reference": reference_fields(c, 2, 1),
        "torch-host": plan_torch(c, 2, 1, None, scan="host"),
        "torch-tensor": plan_torch(c, 2, 1, None, scan="tensor"),
    }
    for name, fields in built.items():
        assert isinstance(fields, PlanFields), name
        p = make_plan(fields, counts=c, num_slots=2, align=1, backend=name)
        for k in PLAN_TENSORS:
            assert torch.equal(getattr(p, k), getattr(want, k)), (name, k)
    a = want.alloc
    for fields in (layout_reference(c, a, 2, 1, None), layout_torch(a, 2, 1, None)):
        assert isinstance(fields, PlanFields)
        assert torch.equal(fields.row_offset, want.row_offset)
        assert fields.flow.tolist() == padded_flows([], 3).tolist()  # no construction record


def test_to_moves_every_field() -> None:
    fields = reference_fields(torch.tensor([[1, 2], [3, 4]]), 1, 1)
    moved = fields.to(torch.device("meta"))
    assert isinstance(moved, PlanFields)
    assert all(t.device.type == "meta" for t in moved)
    assert [t.shape for t in moved] == [t.shape for t in fields]
