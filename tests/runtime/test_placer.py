"""The runtime's placer: ``balance="auto"`` orders refills from the residency, alike on every rank.

Legend: R ranks, E experts, B slots, T tokens (all ranks), H hidden, F ffn, K top-k.
"""

from __future__ import annotations

import torch

import moonplan
from moonplan.runtime.placer import Placer
from moonplan.stepcost import StepCost
from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_moe, dense_weights, split, tokens

H, F, K, TIMEOUT = 8, 12, 2, 120.0


def _cost() -> StepCost:
    """Weight reads nearly free and no tile padding (a replica pays for the balance it buys),
    and a copy dearer than one step's gain: a step buys none itself, the residency's rent
    pays a refill."""
    cost = StepCost.from_hardware("h200-node", "deepseek-v3", plan_us=20.0, exit_us=1.0)
    return cost.scaled(copy_s_intra=5e-6, copy_s_inter=5e-6, weight_read_s=1e-9, tile_rows=1)


def _hot(R: int, E: int, seed: int) -> torch.Tensor:
    c = torch.randint(5, 15, (R, E), generator=torch.Generator().manual_seed(seed))
    c[:, 1] += 300
    return c


def test_the_placer_waits_for_a_cost_model_and_for_a_refill_in_flight() -> None:
    """No cost model, slots or staging: nothing. While a refill is in flight the steps are
    observed and no decision starts; a decision starts from one step and its answer is
    used ``due`` steps later (here 1), on a worker thread in between."""
    p0 = moonplan.plan(_hot(4, 8, 0), slots=2, policy="static")
    assert Placer(2, 1).after_step(_hot(4, 8, 0), p0, None, busy=False) is None
    assert not Placer(0, 1).active(_cost()) and not Placer(2, 0).active(_cost())
    placer = Placer(2, 1)
    got = [placer.after_step(_hot(4, 8, s), p0, _cost(), busy=True) for s in range(5)]
    assert got == [None] * 5 and placer.residency is not None
    assert placer.residency.window.filled == 5  # busy steps are still observed
    assert placer.after_step(_hot(4, 8, 9), p0, _cost(), busy=False) is None  # it starts
    target = placer.after_step(_hot(4, 8, 10), p0, _cost(), busy=False)  # its answer
    assert target is not None and int((target == 1).sum()) >= 1  # the hot expert
    assert placer.orders == 1
    placer.close()


def _serve(rank: int, world: int, E: int, transport: str) -> dict:
    from moonplan import MoonMoE

    sizes = [40 + 4 * r for r in range(world)]
    T = sum(sizes)
    w = dense_weights(E, H, F, seed=3)
    g = torch.Generator().manual_seed(11)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[:, 0] = 1  # a persistent hot expert: every token's first choice
    ids[:, 1] = torch.where(ids[:, 1] == 1, 2, ids[:, 1])
    wk = torch.softmax(torch.randn(T, K, generator=g), -1)
    offset = sum(sizes[:rank])

    def route(x_SH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = x_SH.shape[0]
        return ids[offset : offset + n], wk[offset : offset + n] * (1 + 0 * x_SH.sum())

    layer = MoonMoE(H, F, E, K, slots=2, router=route, balance="auto", cost=_cost(),
                    transport=transport, max_tokens=64)  # fmt: skip
    layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
    x = split(tokens(T, H, 5), sizes)[rank]
    want = split(
        dense_moe(
            tokens(T, H, 5).double(), ids, wk, {n: w[n].double() for n in ("gate_up", "down")}
        ),
        sizes,
    )
    errs = []
    with torch.no_grad():
        for _ in range(12):
            y = layer(x)
            errs.append(float((y.double() - want[rank]).abs().max()))
    rt = layer.runtime
    out = {"errs": errs, "orders": rt.placer.orders, "commits": rt.refill.commits,
           "slots": layer.last_plan.slot_expert.tolist()}  # fmt: skip
    rt.close()
    return out


def test_auto_refills_a_persistent_hot_expert_and_still_equals_the_oracle() -> None:
    for transport in ("heap", "a2a"):
        got = run_ranks(_serve, 2, 6, transport, timeout=TIMEOUT)
        assert got[0]["orders"] == got[1]["orders"] >= 1, got
        assert got[0]["commits"] == got[1]["commits"] >= 1, got
        assert got[0]["slots"] == got[1]["slots"]  # the same table on every rank
        assert 1 in {e for row in got[0]["slots"] for e in row}  # the hot expert stays
        assert max(max(g["errs"]) for g in got) < 1e-4, got
