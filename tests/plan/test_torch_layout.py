"""The torch layout's two forms of step 3 and the short home map agree with their definitions.

Legend: R ranks, E experts, B slots, M candidate columns per rank.

``place_slots_torch`` places CPU tensors rank by rank on the host (``place_slots_host``)
and any other device with masked tensor ops (``place_slots_masked``); both must give the
reference's slots. The masked form is checked on CPU tensors here, and on "meta" tensors
(no values: the path a CUDA tensor takes, which may read nothing on the host).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moonplan.plan.from_alloc import home_layout
from moonplan.plan.home import home_edges, home_list, home_map, home_start
from moonplan.plan.torch_layout import place_slots_host, place_slots_masked, place_slots_torch


@st.composite
def slot_case(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(cand_RM, prev_RB, B)``: distinct candidates per rank (``-1`` padded at the end)
    and previous slots that share some of them, with empty slots anywhere."""
    R = draw(st.integers(1, 6))
    M = draw(st.integers(0, 7))
    B = draw(st.integers(0, M + 2))
    E = draw(st.integers(max(M, B, 1), 16))
    cand, prev = [], []
    for _ in range(R):
        pool = draw(st.permutations(list(range(E))))
        n = draw(st.integers(0, M))
        cand.append(list(pool[:n]) + [-1] * (M - n))
        mixed = draw(st.permutations(list(range(E))))  # residents: some are candidates
        row = [e if draw(st.booleans()) else -1 for e in mixed[:B]]
        prev.append(row)
    as_t = lambda x, cols: torch.tensor(x, dtype=torch.int64).reshape(R, cols)  # noqa: E731
    return as_t(cand, M), as_t(prev, B), B


@given(slot_case())
def test_host_and_masked_slot_placements_agree(
    case: tuple[torch.Tensor, torch.Tensor, int],
) -> None:
    cand_RM, prev_RB, B = case
    host = place_slots_host(cand_RM, prev_RB, B)
    masked = place_slots_masked(cand_RM, prev_RB, B)
    for h, m, name in zip(host, masked, ("slot", "new", "direct"), strict=True):
        assert h.dtype == m.dtype == torch.int64, name
        assert torch.equal(h, m), (name, h.tolist(), m.tolist())
    assert all(torch.equal(a, b) for a, b in zip(place_slots_torch(*case), host, strict=True))


def test_meta_tensors_take_the_masked_path_and_keep_the_shapes() -> None:
    R, M, B = 4, 6, 3
    cand_RM = torch.full((R, M), -1, dtype=torch.int64, device="meta")
    prev_RB = torch.full((R, B), -1, dtype=torch.int64, device="meta")
    slot_RB, new_RB, direct_RD = place_slots_torch(cand_RM, prev_RB, B)
    assert [t.device.type for t in (slot_RB, new_RB, direct_RD)] == ["meta"] * 3
    assert (slot_RB.shape, new_RB.shape, direct_RD.shape) == ((R, B), (R, B), (R, M - B))


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("R, E", [(1, 1), (3, 2), (8, 256), (7, 20), (64, 256), (6, 6), (5, 23)])
def test_home_map_is_the_linear_home_list(device: str, R: int, E: int) -> None:
    home_E = home_map(E, R, device=device)
    assert home_E.dtype == torch.int64 and home_E.shape == (E,) and home_E.device.type == device
    if device == "cpu":
        assert home_E.tolist() == home_list(E, R)
        assert torch.equal(home_layout(E, R, torch.device("cpu"))[0], home_E)


@given(st.integers(1, 70), st.integers(1, 300))
def test_home_map_everywhere(R: int, E: int) -> None:
    assert home_map(E, R).tolist() == home_list(E, R)


@given(st.integers(1, 70), st.integers(1, 300))
def test_home_edges_bound_each_ranks_home_experts(R: int, E: int) -> None:
    edges = home_edges(E, R)
    assert edges == [home_start(r, E, R) for r in range(R + 1)] and edges[-1] == E
    home = home_list(E, R)
    assert all(home[e] == r for r in range(R) for e in range(edges[r], edges[r + 1]))
