"""The all-to-all transport against a single-process oracle, on 1..4 ranks."""

from __future__ import annotations

import pytest
import torch

from moonplan.comm import ContractError, EPGroup, exchange_rows, gather_rows
from moonplan.testing.dist import run_ranks

TIMEOUT = 30.0
FILL = -7.0


def _exchange_problem(world: int, seed: int, H: int, dtype: torch.dtype) -> dict:
    """Every rank's rows, destinations and distinct per-destination offsets (all ranks
    compute the same problem from the seed). Rank 1 (and every rank for seed 0) sends none."""
    g = torch.Generator().manual_seed(seed)
    n_R = torch.randint(0, 9, (world,), generator=g) * (seed != 0)
    if world > 1:
        n_R[1] = 0
    x_R = [torch.randn(int(n), H, generator=g).to(dtype) for n in n_R]
    dest_R = [torch.randint(0, world, (int(n),), generator=g) for n in n_R]
    cap_R = [int(sum(int((d == r).sum()) for d in dest_R)) + 3 for r in range(world)]
    off_R = [torch.empty(int(n), dtype=torch.int64) for n in n_R]
    for r in range(world):
        free = torch.randperm(cap_R[r], generator=g)
        taken = 0
        for s in range(world):
            mask = dest_R[s] == r
            k = int(mask.sum())
            off_R[s][mask] = free[taken : taken + k]
            taken += k
    return {"x": x_R, "dest": dest_R, "off": off_R, "cap": cap_R}


def _exchange_oracle(p: dict, rank: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((p["cap"][rank], H), FILL, dtype=dtype)
    for x, dest, off in zip(p["x"], p["dest"], p["off"], strict=True):
        out[off[dest == rank]] = x[dest == rank]
    return out


def _exchange(rank: int, world: int, seed: int, H: int, dtype: torch.dtype) -> bool:
    p = _exchange_problem(world, seed, H, dtype)
    out = torch.full((p["cap"][rank], H), FILL, dtype=dtype)
    exchange_rows(EPGroup(), p["x"][rank], p["dest"][rank], p["off"][rank], out)
    return torch.equal(out, _exchange_oracle(p, rank, H, dtype))


def _gather(rank: int, world: int, seed: int, H: int, dtype: torch.dtype) -> bool:
    g = torch.Generator().manual_seed(seed)
    src_R = [
        torch.randn(int(c), H, generator=g).to(dtype)
        for c in torch.randint(1, 6, (world,), generator=g)
    ]
    n = 0 if (seed == 0 or rank == 1) else int(torch.randint(0, 12, (1,), generator=g))
    g.manual_seed(seed * 100 + rank)
    want_rank = torch.randint(0, world, (n,), generator=g)
    want_off = (
        torch.stack(
            [torch.randint(0, src_R[r].shape[0], (), generator=g) for r in want_rank.tolist()]
        )
        if n
        else torch.zeros(0, dtype=torch.int64)
    )
    got = gather_rows(EPGroup(), src_R[rank], want_rank, want_off)
    want = (
        torch.stack(
            [src_R[r][o] for r, o in zip(want_rank.tolist(), want_off.tolist(), strict=True)]
        )
        if n
        else torch.zeros(0, H, dtype=dtype)
    )
    return got.shape == (n, H) and got.dtype == dtype and torch.equal(got, want)


CASES = [(1, 3, 4), (2, 1, 1), (2, 0, 3), (3, 2, 7), (4, 5, 16), (4, 0, 2), (3, 4, 0)]


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("world", "seed", "H"), CASES)
def test_exchange_and_gather_match_the_oracle(world, seed, H, dtype):
    def both(rank, world):
        return _exchange(rank, world, seed, H, dtype), _gather(rank, world, seed, H, dtype)

    assert run_ranks(both, world, timeout=TIMEOUT) == [(True, True)] * world


def test_single_rank_without_dist():
    for seed in (0, 3):
        assert _exchange(0, 1, seed, 5, torch.bfloat16)
        assert _gather(0, 1, seed, 5, torch.float32)


def _bad_input(rank: int, world: int, kind: str) -> str:
    group = EPGroup()
    x = torch.ones(2, 4)
    dest = torch.tensor([1, world - 1])
    off = torch.tensor([rank, world + rank])
    out = torch.zeros(2 * world, 4)
    if rank == 1:
        if kind == "dest":
            dest = torch.tensor([0, world])
        elif kind == "negative":
            off = torch.tensor([-1, 0])
        elif kind == "capacity":
            out = torch.zeros(1, 4)  # others send offsets beyond it
        elif kind == "dtype":
            x, out = x.double(), out.double()
        elif kind == "gather":
            off = torch.tensor([0, 99])
    try:
        if kind == "gather":
            gather_rows(group, out, dest, off)
        else:
            exchange_rows(group, x, dest, off, out)
    except ContractError as exc:
        group.barrier()  # still in step
        return str(exc)
    return "no error"


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("dest", "rank 1: rank out of range"),
        ("negative", "rank 1: negative offset"),
        ("capacity", "outside [0, 1)"),
        ("dtype", "row width or dtype differs"),
        ("gather", "asked for rows [99]"),
    ],
)
def test_bad_input_raises_the_same_error_everywhere(kind, needle):
    results = run_ranks(_bad_input, 3, kind, timeout=TIMEOUT)
    assert len(set(results)) == 1, results
    assert needle in results[0], results[0]
