"""Step 3's host form (numpy, the CPU planner's) equals the torch layout and the reference.

Legend: R ranks, E experts, B slots, M candidate columns per rank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moonplan.plan.from_alloc import home_layout
from moonplan.plan.host_backend import home_groups, plan_host
from moonplan.plan.host_layout import (
    place_slots_host_np,
    replica_candidates_host,
    row_layout_host,
)
from moonplan.plan.reference import place_slots
from moonplan.plan.torch_backend import plan_torch
from moonplan.plan.torch_layout import place_slots_masked, replica_candidates, row_layout_torch
from moonplan.testing import counts
from tests.plan.test_torch_layout import slot_case


@given(slot_case(), st.booleans())
def test_slots_equal_the_masked_form_and_the_reference(case: tuple, no_prev: bool) -> None:
    cand_RM, prev_RB, B = case
    if no_prev:
        prev_RB = torch.full_like(prev_RB, -1)
    got = place_slots_host_np(cand_RM.numpy(), None if no_prev else prev_RB.numpy(), B)
    want = place_slots_masked(cand_RM, prev_RB, B)
    for g, w, name in zip(got, want, ("slot", "new", "direct"), strict=True):
        assert g.dtype == np.int64, name
        assert g.tolist() == w.tolist(), name
    for r, (cand, prev) in enumerate(zip(cand_RM.tolist(), prev_RB.tolist(), strict=True)):
        reps = [(e, -i) for i, e in enumerate(x for x in cand if x >= 0)]
        slot, new, direct = place_slots(reps, prev, B)
        assert got[0][r].tolist() == slot and got[1][r].tolist() == new
        assert [e for e in got[2][r].tolist() if e >= 0] == direct


def test_slots_never_alias_their_input() -> None:
    cand = np.array([[3, 1, -1]], dtype=np.int64)
    for B in (0, 1, 3):
        slot, _, direct = place_slots_host_np(cand, np.full((1, B), -1, dtype=np.int64), B)
        direct[:] = 99
        slot[:] = 99
        assert cand.tolist() == [[3, 1, -1]]


@given(counts(max_ranks=7, max_experts=20), st.integers(0, 3), st.sampled_from([1, 4]))
def test_candidates_and_rows_equal_the_torch_layout(
    c: torch.Tensor, extra: int, align: int
) -> None:
    """From the torch backend's own steps 1-2 (tensor scan): the same candidates, rows,
    counts and offsets from host arrays."""
    R, E = c.shape
    p = plan_torch(c, min(E, -(-E // R) + extra), align, None, scan="tensor")
    _, ids_RM = home_layout(E, R, c.device)
    quota_RR = torch.zeros(R, R, dtype=torch.int64)
    real = p["flow"][:, 0] >= 0
    quota_RR[p["flow"][real, 0], p["flow"][real, 1]] = p["flow"][real, 2]
    src_R = torch.full((R,), -1, dtype=torch.int64)
    src_R[p["flow"][real, 1]] = p["flow"][real, 0]
    want, _ = replica_candidates(quota_RR, ids_RM, p["alloc"])
    got = replica_candidates_host(src_R.numpy(), ids_RM.numpy(), p["alloc"].numpy())
    assert got.tolist() == want.tolist()
    D = p["row_expert"].shape[1] - ids_RM.shape[1] - p["slot_expert"].shape[1]
    direct_RD = p["row_expert"][:, p["row_expert"].shape[1] - D :]
    rows = row_layout_host(
        ids_RM.numpy(), p["slot_expert"].numpy(), direct_RD.numpy(), p["alloc"].numpy(), align
    )
    want_rows = row_layout_torch(ids_RM, p["slot_expert"], direct_RD, p["alloc"], align)
    for g, w in zip(rows, want_rows, strict=True):
        assert g.tolist() == w.tolist()


@pytest.mark.parametrize("R, E", [(1, 1), (3, 2), (8, 256), (7, 20), (64, 896), (5, 23)])
def test_home_groups_are_the_home_layout(R: int, E: int) -> None:
    home_E, ids_RM = home_layout(E, R, torch.device("cpu"))
    got_E, got_RM = home_groups(E, R)
    assert got_E.tolist() == home_E.tolist() and got_RM.tolist() == ids_RM.tolist()


@given(counts(max_ranks=7, max_experts=20), st.sampled_from([1, 4]))
def test_host_plan_equals_the_tensor_plan(c: torch.Tensor, align: int) -> None:
    R, E = c.shape
    B = -(-E // R)
    got, want = plan_host(c, B, align, None), plan_torch(c, B, align, None, scan="tensor")
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == torch.int64 and torch.equal(got[k], want[k]), k
