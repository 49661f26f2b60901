"""check_plan catches a plan that breaks each invariant (so the checker can fail)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moonplan
from moonplan import PlanError, check_plan

COUNTS = torch.tensor([[9, 1, 2, 0, 3, 5, 4, 8], [0, 0, 0, 0, 0, 0, 0, 0], [0] * 8, [0] * 8])


def _good() -> moonplan.Plan:
    p = moonplan.plan(COUNTS)
    check_plan(p, COUNTS)
    return p


def _with(p: moonplan.Plan, **fields: torch.Tensor) -> moonplan.Plan:
    return dataclasses.replace(p, **fields)


def _edit(t: torch.Tensor, index: tuple, value: int) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def _move(p: moonplan.Plan, e: int, src: int, dst: int, n: int) -> torch.Tensor:
    a = p.alloc.clone()
    a[e, src] -= n
    a[e, dst] += n
    return a


def test_conservation_broken() -> None:
    p = _good()
    with pytest.raises(PlanError, match="invariant 1"):
        check_plan(_with(p, alloc=_edit(p.alloc, (0, 0), int(p.alloc[0, 0]) + 1)), COUNTS)
    with pytest.raises(PlanError, match=r"invariant 1 \(alloc >= 0\)"):
        check_plan(_with(p, alloc=_edit(p.alloc, (3, 1), -1)), COUNTS)


def test_balance_broken() -> None:
    p = _good()
    with pytest.raises(PlanError, match="invariant 2"):
        check_plan(_with(p, alloc=_move(p, 4, 2, 0, 1)), COUNTS)  # rank 0: 9, rank 2: 7
    with pytest.raises(PlanError, match="invariant 2 \\(targets\\)"):
        check_plan(_with(p, target=torch.tensor([9, 8, 8, 7])), COUNTS)


def test_remote_bound_broken() -> None:
    # E = R: M = 1, so a rank running two remote experts breaks invariant 3.
    c = torch.tensor([[6, 6, 0, 0], [0, 0, 0, 0], [0] * 4, [0] * 4])
    p = moonplan.plan(c)
    a = torch.tensor(
        [[3, 1, 0, 2], [0, 2, 3, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
    )  # rank 3 runs 0 and 1
    with pytest.raises(PlanError, match="invariant 3"):
        check_plan(_with(p, alloc=a), c)


def test_replica_without_slot_or_direct() -> None:
    p = _good()
    with pytest.raises(PlanError, match="invariant 4"):
        check_plan(_with(p, slot_expert=torch.full_like(p.slot_expert, -1)), COUNTS)


def test_slot_holding_home_expert_or_duplicate() -> None:
    p = _good()
    r = int((p.slot_expert[:, 0] >= 0).nonzero()[0])
    home_e = int((p.home == r).nonzero()[0])
    with pytest.raises(PlanError, match="home expert"):
        check_plan(_with(p, slot_expert=_edit(p.slot_expert, (r, 1), home_e)), COUNTS)
    dup = _edit(p.slot_expert, (r, 1), int(p.slot_expert[r, 0]))
    with pytest.raises(PlanError, match="twice"):
        check_plan(_with(p, slot_expert=dup), COUNTS)


def test_slot_new_and_rows_and_flows_checked() -> None:
    p = _good()
    with pytest.raises(PlanError, match="slot_new"):
        check_plan(_with(p, slot_new=torch.zeros_like(p.slot_new)), COUNTS)
    with pytest.raises(PlanError, match="row layout"):
        check_plan(_with(p, row_offset=p.row_offset + 1), COUNTS)
    with pytest.raises(PlanError, match="flow record"):
        check_plan(_with(p, flow=torch.full_like(p.flow, -1)), COUNTS)


def test_counts_mismatch_and_shape() -> None:
    p = _good()
    with pytest.raises(PlanError, match="input"):
        check_plan(p, COUNTS + 1)
    with pytest.raises(PlanError, match="shape contract"):
        check_plan(_with(p, target=p.target[:2]), COUNTS)


def test_policy_agnostic_check_still_catches_broken_plans() -> None:
    # strict=False drops the construction record and exact balance, nothing else.
    p = _good()
    with pytest.raises(PlanError, match="invariant 1"):
        check_plan(
            _with(p, alloc=_edit(p.alloc, (0, 0), int(p.alloc[0, 0]) + 1)), COUNTS, strict=False
        )
    moved = _with(p, alloc=_move(p, 4, 2, 0, 1))  # rank 0: 9 records, its target says 8
    with pytest.raises(PlanError, match="its loads"):
        check_plan(moved, COUNTS, strict=False)
    over = moonplan.Plan.from_alloc(COUNTS, moved.alloc, policy="exact")
    check_plan(over, COUNTS, strict=False)  # imbalanced, within its bound (9)
    with pytest.raises(PlanError, match="invariant 2"):
        check_plan(over, COUNTS)  # an "exact" plan must balance
    with pytest.raises(PlanError, match="declared load bound"):
        check_plan(_with(over, declared_bound=8), COUNTS, strict=False)
    with pytest.raises(PlanError, match="invariant 4"):
        check_plan(_with(p, slot_new=torch.zeros_like(p.slot_new)), COUNTS, strict=False)
    with pytest.raises(PlanError, match="row layout"):
        check_plan(_with(p, row_offset=p.row_offset + 1), COUNTS, strict=False)


def test_non_exact_plans_are_held_to_their_bound_in_strict_mode() -> None:
    c = torch.tensor([[30, 2, 8, 0], [0] * 4, [0] * 4, [0] * 4])
    p = moonplan.plan(c, policy="bounded-0.1")
    check_plan(p, c)
    assert p.load_bound == 11 and int(p.alloc.sum(0).max()) == 11
    with pytest.raises(PlanError, match="declared load bound"):
        check_plan(_with(p, declared_bound=10), c)
