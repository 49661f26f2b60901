"""Per-record routing: every receive row written exactly once, in the documented order."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moonplan
from moonplan import PlanError


@st.composite
def routed_step(draw: st.DrawFn) -> tuple[list[torch.Tensor], dict]:
    """Every rank's top-k ids (duplicates inside a token allowed) and plan options."""
    R = draw(st.integers(1, 5))
    E = draw(st.integers(1, 10))
    K = draw(st.integers(1, 4))
    hot = draw(st.booleans())
    ids = []
    for _ in range(R):
        S = draw(st.sampled_from([0, 1, 3, 17]))
        seed = draw(st.integers(0, 2**16))
        x = torch.randint(0, E, (S, K), generator=torch.Generator().manual_seed(seed))
        ids.append(torch.where(x % 2 == 0, 0, x) if hot else x)
    opts = {"align": draw(st.sampled_from([1, 4])), "slots": draw(st.none() | st.integers(0, 2))}
    return ids, opts


def _counts(ids: list[torch.Tensor], E: int) -> torch.Tensor:
    return torch.stack([torch.bincount(x.reshape(-1), minlength=E) for x in ids])


@given(routed_step())
def test_every_receive_row_written_once_in_order(case: tuple) -> None:
    ids, opts = case
    E = max(1, max((int(x.max()) + 1 for x in ids if x.numel()), default=1))
    c = _counts(ids, E)
    if opts["slots"] is not None:  # the planner refuses slots > E
        opts = {**opts, "slots": min(opts["slots"], E)}
    p = moonplan.plan(c, **opts)
    bufs = [torch.full((int(n),), -1, dtype=torch.int64) for n in p.recv_size().tolist()]
    for s, x in enumerate(ids):
        rt = moonplan.route(p, s, x)
        assert (
            rt.send_counts.tolist()
            == torch.bincount(rt.dest_rank.reshape(-1), minlength=p.num_ranks).tolist()
        )
        for i, (d, o) in enumerate(
            zip(rt.dest_rank.reshape(-1).tolist(), rt.dest_offset.reshape(-1).tolist(), strict=True)
        ):
            assert bufs[d][o] == -1, "a receive position written twice"
            bufs[d][o] = s * 10**6 + i  # source rank, then local order (token-major, then k)
            w = int(torch.searchsorted(p.row_offset[d], torch.tensor(o), right=True)) - 1
            assert int(p.row_expert[d, w]) == int(x.reshape(-1)[i]), (
                "record in another expert's row"
            )
            assert o < int(p.row_offset[d, w]) + int(p.row_count[d, w]), "record in padding"
    for r in range(p.num_ranks):
        for w in range(p.num_rows):
            a, n, end = (
                int(v) for v in (p.row_offset[r, w], p.row_count[r, w], p.row_offset[r, w + 1])
            )
            seg = bufs[r][a : a + n]
            assert bool((seg >= 0).all()), "a valid receive position left unwritten"
            assert bool((seg[1:] > seg[:-1]).all()), (
                "row not ordered by source rank, then local order"
            )
            assert bool((bufs[r][a + n : end] == -1).all()), "padding written"


def test_send_order_groups_by_destination() -> None:
    ids = [torch.tensor([[0, 1], [1, 1], [0, 2]]), torch.tensor([[2, 2], [2, 0]])]
    p = moonplan.plan(_counts(ids, 3))
    rt = moonplan.route(p, 0, ids[0])
    order = rt.send_order()
    keys = [(int(rt.dest_rank.reshape(-1)[i]), int(rt.dest_offset.reshape(-1)[i])) for i in order]
    assert keys == sorted(keys)


@pytest.mark.parametrize(
    ("rank", "ids", "message"),
    [
        (2, torch.tensor([[0]]), r"rank must be an integer in \[0, 2\)"),
        (0, torch.tensor([0, 1]), "2-D"),
        (0, torch.tensor([[0.0]]), "integer expert ids"),
        (0, torch.tensor([[5]]), r"lie in \[0, 2\)"),
        (0, torch.tensor([[1]]), "route 0 records to expert 0"),
        (0, torch.tensor([[-1]]), r"got range \[-1, -1\]"),
        (0, torch.tensor([[65536]]), r"got range \[65536, 65536\]"),  # 0 as a 16-bit key
        (0, torch.tensor([[0], [0]], dtype=torch.int32), "route 2 records to expert 0"),
        (0, torch.zeros(0, 3, dtype=torch.int64), "route 0 records to expert 0"),
    ],
)
@pytest.mark.parametrize("host", [True, False])
def test_route_rejects_bad_input(
    monkeypatch: pytest.MonkeyPatch, rank: int, ids: torch.Tensor, message: str, host: bool
) -> None:
    """The same errors from the host form (numpy, CPU default) and the tensor form."""
    monkeypatch.setattr(importlib.import_module("moonplan.plan.route"), "HOST_FORM", host)
    p = moonplan.plan([[1, 0], [0, 0]])
    with pytest.raises(PlanError, match=message):
        moonplan.route(p, rank, ids)
