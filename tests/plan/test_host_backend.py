"""The planner's host form (``host_backend``, CPU tensors) equals the tensor form, and
its home layout kept per shape is the torch one and stays unchanged.

Legend: R ranks, E experts, B slots. Against the reference, with ``previous=`` chains:
``tests/plan/test_backends.py`` (``scan="host"``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moonplan
from moonplan.plan.from_alloc import home_layout
from moonplan.plan.host_backend import host_home, plan_host
from moonplan.plan.plan_fields import PlanFields
from moonplan.plan.torch_backend import plan_torch
from moonplan.testing import counts


@pytest.mark.parametrize("R, E", [(1, 1), (3, 2), (8, 256), (7, 20), (64, 896), (5, 23)])
def test_host_home_is_the_home_layout(R: int, E: int) -> None:
    home_E, ids_RM = home_layout(E, R, torch.device("cpu"))
    home = host_home(E, R)
    assert home.home_E.tolist() == home_E.tolist() and home.ids_RM.tolist() == ids_RM.tolist()
    assert home.rows_RM.tolist() == torch.where(ids_RM < E, ids_RM, -1).tolist()
    assert home.cell_E.tolist() == [e * R + h for e, h in enumerate(home_E.tolist())]
    assert home.edges == [0, *torch.bincount(home_E, minlength=R).cumsum(0).tolist()]
    arrays = (home.home_E, home.ids_RM, home.rows_RM, home.cell_E)
    assert not any(a.flags.writeable for a in arrays)  # kept per (E, R)


@given(counts(max_ranks=7, max_experts=20), st.sampled_from([1, 4]))
def test_host_plan_equals_the_tensor_plan(c: torch.Tensor, align: int) -> None:
    R, E = c.shape
    B = -(-E // R)
    got, want = plan_host(c, B, align, None), plan_torch(c, B, align, None, scan="tensor")
    for k, x, y in zip(PlanFields._fields, got, want, strict=True):
        assert x.dtype == torch.int64 and torch.equal(x, y), k
    got.home.add_(1)  # the plan's own copy, not the array kept per (E, R)
    assert host_home(E, R).home_E.tolist() == want.home.tolist()


@given(counts(max_ranks=7, max_experts=20), st.integers(0, 2), st.sampled_from([1, 4]))
def test_host_plan_with_previous_equals_the_tensor_plan(
    c: torch.Tensor, extra: int, align: int
) -> None:
    """With residents in every rank's slots (the masked slot placement on the host)."""
    R, E = c.shape
    B = min(E, -(-E // R) + extra)
    prev = moonplan.plan(torch.flip(c, [1]), slots=B, align=align)
    args = (c, B, align, prev.slot_expert, prev.flow)
    got, want = plan_host(*args), plan_torch(*args, scan="tensor")
    for k, x, y in zip(PlanFields._fields, got, want, strict=True):
        assert torch.equal(x, y), k
