"""Plain routing's host form (numpy, the CPU default) equals the tensor form and the
reference bit for bit, on random, adversarial and hypothesis-drawn plans and ids.

Legend: R ranks, E experts, S tokens, K top-k.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given

import moonplan
from moonplan.plan.route_host import route_host, row_cells_host, sort_keys
from moonplan.plan.route_reference import route_reference
from tests.plan.test_route_rows import FIELDS, routed

route_mod = importlib.import_module("moonplan.plan.route")  # the package exports route()


def _forms(p: moonplan.Plan, s: int, x: torch.Tensor) -> tuple[moonplan.Route, moonplan.Route]:
    """``route(p, s, x)`` in the host form and in the tensor form."""
    host = moonplan.route(p, s, x)
    try:
        route_mod.HOST_FORM = False
        tensor = moonplan.route(p, s, x)
    finally:
        route_mod.HOST_FORM = True
    return host, tensor


def _assert_same(p: moonplan.Plan, s: int, x: torch.Tensor) -> None:
    host, tensor = _forms(p, s, x)
    want = route_reference(p, s, x)
    for rt in (host, tensor):
        assert rt.affinity is False
        for f in FIELDS:
            got = getattr(rt, f)
            assert got.dtype == torch.int64, f
            assert got.reshape(-1).tolist() == want[f], f
    assert host.dest_rank.shape == tensor.dest_rank.shape == x.shape


@given(routed())
def test_host_form_equals_tensor_form_and_reference(case: tuple) -> None:
    p, ids = case
    for s, x in enumerate(ids):
        _assert_same(p, s, x)


def test_host_cells_are_the_tensor_cells_that_take_records() -> None:
    """``row_cells_host`` keeps only live rows; where a tensor cell takes records, the
    host form has the same cell (rank, base and take) in the same order."""
    gen = torch.Generator().manual_seed(3)
    c = torch.randint(0, 50, (6, 20), generator=gen)
    c[:, 4] *= 40  # a hot expert, split over several ranks
    p = moonplan.plan(c, slots=2, align=8)
    for s in range(6):
        take_C, base_C, dest_C, _ = route_mod._row_cells(p, s)
        take_L, base_L, dest_L = (torch.from_numpy(a) for a in row_cells_host(p, s))
        used_C, used_L = take_C > 0, take_L > 0
        assert torch.equal(take_C[used_C], take_L[used_L])
        assert torch.equal(base_C[used_C], base_L[used_L])
        assert torch.equal(dest_C[used_C], dest_L[used_L])


@pytest.mark.parametrize(
    "R, E, S, K, sigma",
    [(1, 1, 5, 1, 0.0), (4, 2, 33, 2, 2.0), (3, 11, 0, 4, 1.0), (8, 64, 257, 8, 2.0)],
)
def test_host_form_on_adversarial_shapes(R: int, E: int, S: int, K: int, sigma: float) -> None:
    """One rank, fewer experts than ranks, no tokens, one very hot expert."""
    gen = torch.Generator().manual_seed(R * 100 + E)
    pop_E = torch.exp(sigma * torch.randn(E, generator=gen))
    ids = [
        torch.multinomial(pop_E, S * K, replacement=True, generator=gen).view(S, K)
        if S
        else torch.zeros(0, K, dtype=torch.int64)
        for _ in range(R)
    ]
    c = torch.stack([torch.bincount(x.reshape(-1), minlength=E) for x in ids])
    for opts in ({}, {"slots": 0}, {"slots": 1, "align": 4}):
        p = moonplan.plan(c, **opts)
        for s, x in enumerate(ids):
            _assert_same(p, s, x)


@pytest.mark.parametrize("E", [40_000, 70_000])
def test_host_form_with_wide_expert_ids(E: int) -> None:
    """Keys beyond int16 (the tensor form widens to int32) and beyond uint16 (the host
    form widens to int32): the same routes."""
    R, K = 2, 2
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(E - 50, E, (30, K), generator=gen) for _ in range(R)]
    ids[0][:, 0] = 7  # ids on both sides of 2**15
    c = torch.stack([torch.bincount(x.reshape(-1), minlength=E) for x in ids])
    p = moonplan.plan(c)
    for s, x in enumerate(ids):
        host, tensor = _forms(p, s, x)
        for f in ("dest_rank", "dest_offset", "send_counts"):
            assert torch.equal(getattr(host, f), getattr(tensor, f)), f


def test_host_form_takes_any_integer_ids() -> None:
    """int32 ids route as int64 ones; ``route_host`` is what ``route`` returns, flat."""
    p = moonplan.plan(torch.tensor([[3, 1, 4], [1, 5, 0]]))
    x = torch.tensor([[0, 1], [0, 2], [0, 2], [2, 2]], dtype=torch.int32)
    host, tensor = _forms(p, 0, x)
    assert torch.equal(host.dest_rank, tensor.dest_rank)
    assert torch.equal(host.dest_offset, tensor.dest_offset)
    dest_N, offset_N, send_R = route_host(p, 0, sort_keys(x.reshape(-1).to(torch.int64).numpy(), 3))
    assert dest_N.tolist() == host.dest_rank.reshape(-1).tolist()
    assert offset_N.tolist() == host.dest_offset.reshape(-1).tolist()
    assert send_R.tolist() == host.send_counts.tolist()


def test_affinity_is_an_option_off_by_default() -> None:
    p = moonplan.plan(torch.tensor([[6, 2], [0, 0]]))
    x = torch.tensor([[0, 1], [0, 0], [0, 1], [0, 0]])
    assert moonplan.route(p, 0, x).affinity is False
    assert moonplan.route(p, 0, x, affinity=True).affinity is True
