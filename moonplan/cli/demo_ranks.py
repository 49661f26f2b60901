"""What every rank of ``moonplan demo`` runs (and the single process that checks them).

Legend: E experts, H hidden, F ffn, K top-k, S tokens of a rank.

``rank_main`` builds the demo's ``MoonMoE`` (the same weights on every rank), routes
each step's tokens with a lognormal, AR(1)-drifting popularity bias added to the router
logits (``popularity_bias``), and returns the outputs and, on rank 0, the step figures.
The router's logits are computed in fp64 and rounded to fp32, so that the top-k choice
is the same whatever the number of rows (see ``moonplan.cli.demo``).
``moonplan profile`` reuses ``popularity_bias`` and ``step_tokens``.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.runtime.routers import softmax_topk
from moonplan.traces.drift import drift_log_popularity, start_log_popularity

DEMO_RHO = 0.99
"""Step-to-step correlation of the demo's drifting popularity."""


def popularity_bias(cfg: dict, step: int) -> torch.Tensor:
    """float32 ``[E]`` log-popularity added to the router logits at ``step``: lognormal,
    AR(1)-drifting over steps (``traces.drift``, ``rho = DEMO_RHO``)."""
    g = torch.Generator().manual_seed(cfg["seed"])
    x_E = start_log_popularity(cfg["experts"], cfg["sigma"], g, torch.float32)
    for _ in range(step):
        x_E = drift_log_popularity(x_E, cfg["sigma"], DEMO_RHO, g)
    return x_E


def step_tokens(cfg: dict, step: int, sizes: list[int]) -> torch.Tensor:
    """float32 ``[sum(sizes), H]`` tokens of every rank at ``step`` (rank ``r``'s are rows
    ``sum(sizes[:r])`` onwards), the same in every process."""
    g = torch.Generator().manual_seed(1000 * cfg["seed"] + step)
    return torch.randn(sum(sizes), cfg["hidden"], generator=g)


def rank_main(
    rank: int, world: int, cfg: dict, sizes: list[int], group: Any = None, what: str = "ranks"
) -> dict:
    """One rank: run the steps; return its outputs and (on rank 0) the step figures.

    ``group``: the layer's group (default: the default process group). Rank 0 reports
    each step on stderr (``what`` names the run) unless ``cfg["progress"]`` is false.
    """
    from moonplan import MoonMoE
    from moonplan.simulate.progress import ProgressBar

    bar = ProgressBar(description=f"demo {what}") if rank == 0 and cfg["progress"] else None
    torch.manual_seed(cfg["seed"])
    state: dict[str, Any] = {}

    def router(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # fp64 then fp32: the same logits bits whatever the number of rows (module doc)
        w = state["layer"].router.weight.double()
        logits = torch.nn.functional.linear(x.double(), w).float()
        return softmax_topk(logits + state["bias"], cfg["topk"])

    layer = MoonMoE(
        cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["topk"], router=router, group=group
    )
    g = torch.Generator().manual_seed(cfg["seed"] + 7)
    E, H, F = cfg["experts"], cfg["hidden"], cfg["ffn"]
    layer.load_dense(
        torch.randn(E, H, generator=g) * H**-0.5,
        torch.randn(E, 2 * F, H, generator=g) * H**-0.5,
        torch.randn(E, H, F, generator=g) * F**-0.5,
    )
    state["layer"] = layer
    first = sum(sizes[:rank])
    outs, stats = [], []
    for step in range(cfg["steps"]):
        state["bias"] = popularity_bias(cfg, step)
        x = step_tokens(cfg, step, sizes)[first : first + sizes[rank]].to(layer.group.device)
        with torch.no_grad():
            outs.append(layer(x).cpu())
        stats.append(layer.last_stats)
        if bar is not None:
            bar(step + 1, cfg["steps"], f"step {step + 1}")
    return {"outs": outs, "stats": stats if rank == 0 else None}
