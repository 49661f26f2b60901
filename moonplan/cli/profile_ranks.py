"""What every rank of ``moonplan profile`` runs: the demo model, warm-up, profiled steps.

Legend: R ranks, E experts, H hidden, F ffn, K top-k, S tokens of a rank, T trace steps.

``rank_main`` builds ``cfg["layers"]`` stacked ``MoonMoE`` layers (residual
connections), routes with the demo's drifting lognormal bias or, with a trace, exactly
the recorded counts (``ids_from_counts``), runs the warm-up steps, then the profiled
ones inside :func:`moonplan.profiling.session.profiling`; rank 0 returns the report.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.cli.demo_ranks import popularity_bias, step_tokens
from moonplan.runtime.routers import softmax_topk


def ids_from_counts(counts_E: torch.Tensor, topk: int) -> torch.Tensor:
    """int64 ``[S, K]`` expert ids whose counts are exactly ``counts_E`` (``S = sum / K``).

    Records are laid out expert by expert and dealt column-wise, so a token's ``K``
    picks are distinct whenever no expert has more than ``S`` records.
    """
    flat = torch.repeat_interleave(torch.arange(counts_E.numel()), counts_E.cpu())
    return flat.view(topk, -1).t().contiguous()


def _build_layers(cfg: dict, state: dict[str, Any]) -> list[torch.nn.Module]:
    from moonplan import MoonMoE

    E, H, F, K = cfg["experts"], cfg["hidden"], cfg["ffn"], cfg["topk"]
    layers: list[torch.nn.Module] = []
    for i in range(cfg["layers"]):
        router = _trace_router(state, i) if cfg["traced"] else _skew_router(state, i, K)
        layer = MoonMoE(H, F, E, K, router=router, max_tokens=cfg["tokens"])
        g = torch.Generator().manual_seed(cfg["seed"] + 7 + i)
        layer.load_dense(
            torch.randn(E, H, generator=g) * H**-0.5,
            torch.randn(E, 2 * F, H, generator=g) * H**-0.5,
            torch.randn(E, H, F, generator=g) * F**-0.5,
        )
        layers.append(layer)
    state["layers"] = layers
    return layers


def _skew_router(state: dict[str, Any], i: int, K: int) -> Any:
    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(state["layers"][i].router(x) + state["bias"], K)

    return route


def _trace_router(state: dict[str, Any], i: int) -> Any:
    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids_SK = state["ids"]
        w_SK = torch.softmax(state["layers"][i].router(x).float(), -1).gather(1, ids_SK)
        return ids_SK, (w_SK / w_SK.sum(1, keepdim=True).clamp_min(1e-20)).to(x.dtype)

    return route


def _inputs(cfg: dict, trace: torch.Tensor | None, step: int, rank: int, world: int) -> Any:
    """This rank's tokens ``[S, H]`` of ``step``; sets the routing state's input."""
    if trace is None:
        sizes = [cfg["tokens"]] * world
        first = cfg["tokens"] * rank
        return step_tokens(cfg, step, sizes)[first : first + cfg["tokens"]], None
    ids_SK = ids_from_counts(trace[step % trace.shape[0], rank], cfg["topk"])
    g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + step * 1009 + rank)
    return torch.randn(ids_SK.shape[0], cfg["hidden"], generator=g), ids_SK


def _run_step(cfg: dict, trace: Any, state: dict[str, Any], step: int, rank: int, world: int):
    layers = state["layers"]
    dev = layers[0].group.device
    x, ids = _inputs(cfg, trace, step, rank, world)
    state["ids"] = None if ids is None else ids.to(dev)
    if trace is None:
        state["bias"] = popularity_bias(cfg, step).to(dev)
    h = x.to(dev)
    with torch.set_grad_enabled(cfg["backward"]):
        for layer in layers:
            h = h + layer(h)
        if cfg["backward"]:
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            h.float().square().mean().backward()


def rank_main(rank: int, world: int, cfg: dict, trace: torch.Tensor | None) -> Any:
    """One rank: warm up, profile ``steps`` steps; rank 0 returns the ProfileReport."""
    from moonplan.profiling.session import profiling

    torch.manual_seed(cfg["seed"])
    state: dict[str, Any] = {}
    layers = _build_layers(cfg, state)
    for step in range(cfg["warmup"]):
        _run_step(cfg, trace, state, step, rank, world)
    with profiling(layers, aligned=cfg["aligned"]) as prof:
        for step in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
            _run_step(cfg, trace, state, step, rank, world)
    return prof.report if rank == 0 else None
