"""``moonplan.plan.candidates``: the ``resident`` allocation's fast twin against its definition.

Legend: R ranks, E experts, B slots; counts int64 ``[R, E]``, slots int64 ``[R, B]``.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from moonplan.plan.candidates import resident_alloc, resident_alloc_reference
from moonplan.testing import counts

COUNTS = counts(max_ranks=8, max_experts=20, max_records_per_rank=300)


@st.composite
def slots_for(draw: st.DrawFn, c: torch.Tensor) -> torch.Tensor:
    """Previous slots ``[R, B]`` of any experts (``-1`` empty; home experts and repeats too)."""
    R, E = c.shape
    B = draw(st.integers(0, min(E, 4)))
    cells = st.integers(-1, E - 1)
    rows = draw(st.lists(st.lists(cells, min_size=B, max_size=B), min_size=R, max_size=R))
    return torch.tensor(rows, dtype=torch.int64).reshape(R, B)


@given(st.data())
def test_resident_alloc_is_the_reference_move_for_move(data: st.DataObject) -> None:
    c = data.draw(COUNTS)
    prev_RB = data.draw(slots_for(c))
    want = resident_alloc_reference(c.tolist(), prev_RB.tolist())
    got = resident_alloc(c, prev_RB)
    assert got.tolist() == want


def test_many_residents_on_few_receivers_take_turns() -> None:
    """Two overloaded homes, every other rank holding replicas of both: the moves go to
    the largest excess first, then the largest deficit, as the reference's scan does."""
    R, E = 6, 12
    c = torch.zeros(R, E, dtype=torch.int64)
    c[:, 0], c[:, 1], c[:, 2] = 50, 30, 40  # experts 0, 1 on rank 0; 2 on rank 1
    prev_RB = torch.tensor([[-1, -1], [-1, -1], [0, 2], [1, 2], [0, 1], [2, 0]])
    got = resident_alloc(c, prev_RB)
    assert got.tolist() == resident_alloc_reference(c.tolist(), prev_RB.tolist())
    assert int(got[:, 2:].sum()) > 0  # records really moved to the residents
