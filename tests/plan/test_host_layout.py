"""Step 3's host form (numpy, the CPU planner's) equals the torch layout and the reference.

Legend: R ranks, E experts, B slots, M candidate columns per rank.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from moonplan.plan.from_alloc import home_layout
from moonplan.plan.host_backend import steps12_host
from moonplan.plan.host_layout import candidates_from_moves, place_slots_host_np, row_layout_host
from moonplan.plan.reference import place_slots
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
    """From the host steps 1-2: the torch layout's candidates (from the quotas and the
    allocation), rows, counts and offsets."""
    R, E = c.shape
    M = -(-E // R)
    steps = steps12_host(c, None, None)
    _, ids_RM = home_layout(E, R, c.device)
    quota_RR = torch.zeros(R, R, dtype=torch.int64)
    for d, r, q in steps.split.flows:
        quota_RR[d, r] = q
    alloc_ER = torch.from_numpy(steps.alloc_ER)
    want, _ = replica_candidates(quota_RR, ids_RM, alloc_ER)
    got = candidates_from_moves(steps.split.moves, R, M)
    assert got.tolist() == want.tolist()
    B = min(E, M + extra)
    slot_RB, _, direct_RD = place_slots_masked(want, torch.full((R, B), -1), B)
    home_RM = torch.where(ids_RM < E, ids_RM, -1).numpy()
    rows = row_layout_host(home_RM, slot_RB.numpy(), direct_RD.numpy(), steps.alloc_ER, align)
    want_rows = row_layout_torch(ids_RM, slot_RB, direct_RD, alloc_ER, align)
    for g, w in zip(rows, want_rows, strict=True):
        assert g.tolist() == w.tolist()
