"""A short Adam training run through MoonMoE on 3 ranks follows the single-process run."""

from __future__ import annotations

import pytest
import torch

from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_weights, split, tokens

pytestmark = pytest.mark.distributed

H, F, E, K, STEPS = 8, 12, 6, 2, 20
SIZES = [6, 9, 5]


def _train(rank: int, world: int, sizes: list[int]) -> list[float]:
    """Toy regression: every rank fits its token slice; returns the global loss per step."""
    from moonplan import MoonMoE
    from moonplan.comm.group import EPGroup

    torch.manual_seed(0)
    w = dense_weights(E, H, F, seed=11)
    x_all, y_all = tokens(sum(sizes), H, 11), tokens(sum(sizes), H, 12)
    x, target = split(x_all, sizes)[rank], split(y_all, sizes)[rank]
    layer = MoonMoE(H, F, E, K, slots=1)
    layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    group = EPGroup()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ((layer(x) - target) ** 2).sum() / sum(sizes)
        loss.backward()
        if world > 1:  # replicated router: data-parallel all-reduce of its gradient
            torch.distributed.all_reduce(layer.router.weight.grad)
        losses.append(float(group.all_gather(loss.detach().reshape(1)).sum()))
        opt.step()  # changes the home experts in place: slots are refreshed next step
    return losses


def test_three_rank_adam_run_matches_single_process() -> None:
    dist_losses = run_ranks(_train, 3, SIZES, timeout=180)[0]
    single = run_ranks(_train, 1, [sum(SIZES)], timeout=180)[0]
    assert dist_losses[-1] < dist_losses[0]  # it learns
    for a, b in zip(dist_losses, single, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (dist_losses, single)
