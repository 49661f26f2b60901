"""The serving plan a refill leaves: static EP's records over a given slot table."""

from __future__ import annotations

import pytest
import torch

import moonplan
from moonplan.errors import PlanError
from moonplan.plan.residency.serving import serving_plan


def test_the_serving_plan_holds_the_slots_resident_and_is_valid() -> None:
    c = torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([[5, -1], [0, 9], [-1, -1], [1, 2]])
    p = serving_plan(c, slots)
    assert torch.equal(p.slot_expert, slots) and not bool(p.slot_new.any())
    moonplan.check_plan(p, c, previous=p)
    nxt = moonplan.plan(c, slots=2, previous=p, policy="resident")  # the next step's plan
    assert torch.equal(nxt.slot_expert, slots) and nxt.new_copies() == 0


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        ([[5, 5], [0, 9], [-1, -1], [1, 2]], "twice"),
        ([[0, -1], [3, 9], [-1, -1], [1, 2]], "own home"),
        ([[10, -1], [0, 9], [-1, -1], [1, 2]], "outside"),
        ([[5, -1], [0, 9], [-1, -1]], r"\[R=4, B\]"),
    ],
)
def test_a_bad_slot_table_is_refused(slots: list[list[int]], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        serving_plan(torch.ones(4, 10, dtype=torch.int64), torch.tensor(slots))
