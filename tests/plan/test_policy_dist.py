"""``policy="auto"`` picks the same plan on every rank of a real process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moonplan
from moonplan.stepcost import StepCost
from moonplan.testing.dist import run_ranks
from moonplan.traces import popularity, sample_topk

pytestmark = pytest.mark.distributed


def _rank_main(rank: int, world: int, experts: int, steps: int) -> list[tuple]:
    # Each rank measures slightly different rates; agreeing on the max makes them equal.
    base = StepCost.from_hardware("h200-node", "deepseek-v3", plan_us=20.0, exit_us=1.0)
    mine = base.scaled(copy_s_intra=base.copy_s_intra * 0.01 * (1 + 0.1 * rank))
    rates = mine.as_tensor()
    dist.all_reduce(rates, op=dist.ReduceOp.MAX)
    cost = StepCost.from_tensor(rates, tile_rows=base.tile_rows, domain=base.domain)
    gen = torch.Generator().manual_seed(100 + rank)  # every rank routes its own tokens
    prev, out = None, []
    for step in range(steps):
        pop_E = popularity("lognormal", experts, sigma=1.5, generator=gen)
        ids_SK = sample_topk(pop_E, 64 * (1 + step), 4, gen)
        local_E = torch.bincount(ids_SK.reshape(-1), minlength=experts)
        rows = [torch.zeros_like(local_E) for _ in range(world)]
        dist.all_gather(rows, local_E)
        counts_RE = torch.stack(rows)
        p = moonplan.plan(counts_RE, slots=2, previous=prev, policy="auto", cost=cost)
        out.append(
            (
                p.policy,
                p.choice.scores.tolist(),  # every candidate's score, bit for bit
                p.choice.early_exit(),
                p.alloc.tolist(),
                p.slot_expert.tolist(),
                p.flow.tolist(),
            )
        )
        prev = p
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_chooses_the_same_plan(world: int) -> None:
    results = run_ranks(_rank_main, world, 16, 4, timeout=60.0)
    for r in range(1, world):
        assert results[r] == results[0], f"rank {r} differs from rank 0"
    assert any(not step[2] for step in results[0])  # some step scored every candidate
