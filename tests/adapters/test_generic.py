"""``wrap_experts``: a hand-written MoE layer (router function + SwiGLU weights) over ranks.

Legend: R ranks, E experts, S tokens, H hidden, F ffn, K top-k.

Oracle: the same layer computed densely in one process (per-expert loops, plain torch).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F_
from torch import nn

from moonplan.runtime.routers import softmax_topk
from moonplan.testing.dist import RankError, run_ranks
from tests.adapters.checks import rel_close

pytestmark = pytest.mark.distributed

H, F, K = 8, 6, 2


class Router(nn.Module):
    """A hand-written softmax top-k router: ``x [S, H] -> (ids [S, K], weights [S, K])``."""

    def __init__(self, E: int, fail_on_rank: int | None = None):
        super().__init__()
        self.proj = nn.Linear(H, E, bias=False)
        self.top_k, self.fail_on_rank = K, fail_on_rank

    def forward(self, x_SH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        if self.fail_on_rank is not None and dist.get_rank() == self.fail_on_rank:
            raise RuntimeError("router exploded")
        return softmax_topk(self.proj(x_SH), self.top_k)


def _weights(E: int) -> dict:
    g = torch.Generator().manual_seed(11)
    return {
        "router": torch.randn(E, H, generator=g),
        "gate_up": torch.randn(E, 2 * F, H, generator=g) * 0.4,
        "down": torch.randn(E, H, F, generator=g) * 0.4,
        "shared": torch.randn(H, H, generator=g) * 0.3,
    }


def _layer_parts(E: int, fail_on_rank: int | None = None) -> tuple[Router, nn.Linear]:
    w = _weights(E)
    router, shared = Router(E, fail_on_rank), nn.Linear(H, H, bias=False)
    with torch.no_grad():
        router.proj.weight.copy_(w["router"])
        shared.weight.copy_(w["shared"])
    return router, shared


def _dense(x_SH, router, shared, gate_up, down):
    ids_SK, w_SK = router(x_SH)
    y = shared(x_SH)
    for k in range(K):
        gu = torch.einsum("sfh,sh->sf", gate_up[ids_SK[:, k]], x_SH)
        h = F_.silu(gu[:, :F]) * gu[:, F:]
        y = y + w_SK[:, k, None] * torch.einsum("shf,sf->sh", down[ids_SK[:, k]], h)
    return y


def _inputs(sizes: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(s, H, generator=g) for s in sizes]


def _rank(rank: int, world: int, E: int, sizes: list[int], fail_on_rank=None) -> dict:
    from moonplan.adapters import wrap_experts

    router, shared = _layer_parts(E, fail_on_rank)
    w = _weights(E)
    layer = wrap_experts(router, w["gate_up"], w["down"], shared_experts=shared)
    x = _inputs(sizes)[rank].clone().requires_grad_(True)
    y = layer(x)
    y.square().sum().backward()
    return {
        "y": y.detach(),
        "dx": x.grad,
        "home": layer.home_experts.tolist(),
        "grads": {n: p.grad for n, p in layer.named_parameters()},
        "names": sorted(n for n, _ in layer.named_parameters()),
    }


def _reference(E: int, sizes: list[int]) -> tuple[list, dict, list]:
    w = _weights(E)
    gate_up = w["gate_up"].clone().requires_grad_(True)
    down = w["down"].clone().requires_grad_(True)
    outs, local = [], []
    for x in _inputs(sizes):
        router, shared = _layer_parts(E)
        x = x.clone().requires_grad_(True)
        y = _dense(x, router, shared, gate_up, down)
        y.square().sum().backward()
        outs.append((y.detach(), x.grad))
        local.append(
            {"router.proj.weight": router.proj.weight.grad, "shared.weight": shared.weight.grad}
        )
    return outs, {"gate_up_proj": gate_up.grad, "down_proj": down.grad}, local


@pytest.mark.parametrize(("world", "E", "sizes"), [(2, 5, [6, 4]), (3, 2, [5, 0, 7])])
def test_wrap_experts_matches_dense_layer(world: int, E: int, sizes: list[int]) -> None:
    got = run_ranks(_rank, world, E, sizes, timeout=60)
    outs, total, local = _reference(E, sizes)
    assert [e for g in got for e in g["home"]] == list(range(E))  # E < R: a rank owns none
    for r, g in enumerate(got):
        assert g["names"] == sorted(
            [
                "router.proj.weight",
                "experts.gate_up_proj",
                "experts.down_proj",
                "shared_experts.weight",
            ]
        )
        rel_close(g["y"], outs[r][0], what=f"rank {r} output")
        rel_close(g["dx"], outs[r][1], what=f"rank {r} input grad")
        for name in ("gate_up_proj", "down_proj"):
            rel_close(g["grads"][f"experts.{name}"], total[name][g["home"]], what=name)
        rel_close(g["grads"]["router.proj.weight"], local[r]["router.proj.weight"], what="router")
        rel_close(g["grads"]["shared_experts.weight"], local[r]["shared.weight"], what="shared")


def test_a_router_failure_on_one_rank_raises_on_every_rank() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(_rank, 3, 4, [3, 3, 3], 1, timeout=60)
    failures = info.value.failures
    assert [f.rank for f in failures] == [0, 1, 2]
    for f in failures:
        assert f.type_name.endswith("ContractError") and "router exploded" in f.message


def test_wrap_experts_needs_top_k() -> None:
    from moonplan.adapters import wrap_experts

    w = _weights(3)
    with pytest.raises(ValueError, match="top_k"):
        wrap_experts(lambda x: x, w["gate_up"], w["down"])
