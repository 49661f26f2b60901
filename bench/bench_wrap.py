"""Wrapped transformers blocks against the original block, side by side (R = 2, CPU ranks).

Two ranks (fork, gloo) build the same block three ways and time forward + backward in
turn (A B C A B C ...) in the same processes:

* ``original``: the transformers block itself on the rank's tokens (every expert local:
  what each rank computes without expert parallelism);
* ``moonplan``: ``moonplan.wrap(block)``: home experts only, exactly balanced;
* ``static``: the same wrapping with planning off (every record on its home rank).

Routing is skewed through the block's own router: Mixtral by adding a lognormal offset
to each expert's logit through the gate weights (tokens share a mean direction ``u``,
``gate.weight[e] += s_e u / |u|^2``), DeepSeek-V3 through its ``e_score_correction_bias``.
Rank 0's barrier-aligned wall time per step (median) is reported. Writes JSON (``--out``).

    python bench/bench_wrap.py            # H=256, F=512, E=8, K=2, 1024 tokens/rank
    python bench/bench_wrap.py --quick    # small sizes (smoke test)
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import bench_parser, result_path, write_json
from torch import nn

from moonplan.testing.dist import run_ranks


def _block(kind: str, cfg: dict) -> nn.Module:
    import transformers as tf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    H, F, E, K = cfg["H"], cfg["F"], cfg["E"], cfg["K"]
    if kind == "mixtral":
        conf: Any = tf.MixtralConfig(
            hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K
        )
        cls: Any = MixtralSparseMoeBlock
    else:
        conf = tf.DeepseekV3Config(
            hidden_size=H,
            moe_intermediate_size=F,
            n_routed_experts=E,
            num_experts_per_tok=K,
            n_group=2,
            topk_group=2,
            n_shared_experts=1,
        )
        cls = DeepseekV3MoE
    conf._experts_implementation = "grouped_mm"
    block = cls(conf)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return block


def _skew(block: Any, kind: str, cfg: dict, u_H: torch.Tensor) -> None:
    """Skew the block's routing through its own router parameters (lognormal popularity)."""
    s_E = torch.randn(cfg["E"], generator=torch.Generator().manual_seed(1)) * cfg["sigma"]
    with torch.no_grad():
        if kind == "mixtral":  # logit offset s_e for every token carrying the direction u
            block.gate.weight += s_E[:, None] * u_H[None, :] / u_H.square().sum()
        else:  # selection-only bias on sigmoid scores in (0, 1)
            block.gate.e_score_correction_bias.copy_(0.25 * s_E)


def _step(module: nn.Module, x: torch.Tensor) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    module(x).square().mean().backward()
    dist.barrier()
    return time.perf_counter() - t0


def _rank(rank: int, world: int, kind: str, cfg: dict) -> dict:
    from moonplan import adapters

    torch.set_num_threads(1)
    u_H = torch.randn(cfg["H"], generator=torch.Generator().manual_seed(2))
    x = torch.randn(1, cfg["S"], cfg["H"], generator=torch.Generator().manual_seed(10 + rank))
    x = x + u_H  # every token shares the mean direction the Mixtral skew acts on
    original = _block(kind, cfg)
    _skew(original, kind, cfg, u_H)
    modules = {
        "original": original,
        "moonplan": adapters.wrap(copy.deepcopy(original), max_tokens=cfg["S"], balance="exact"),
        "static": adapters.wrap(copy.deepcopy(original), max_tokens=cfg["S"], balance="off"),
    }
    times: dict[str, list[float]] = {k: [] for k in modules}
    for i in range(cfg["reps"] + 2):
        for name, module in modules.items():
            dt = _step(module, x)
            if i >= 2:
                times[name].append(dt)
    moon: Any = modules["moonplan"]
    stats = moon.experts.runtime.last_stats
    return {
        **{k: statistics.median(v) for k, v in times.items()},
        "static_max_over_mean": stats.static_max_over_mean if stats else 1.0,
        "copies": stats.copies if stats else 0,
    }


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sigma", type=float, default=1.5, help="lognormal skew (default 1.5)")
    ap.add_argument("--out", default=result_path("bench_wrap.json"))
    args = ap.parse_args()
    cfg = {"E": 8, "K": 2, "H": 256, "F": 512, "S": 1024, "reps": args.reps, "sigma": args.sigma}
    if args.quick:
        cfg.update(H=64, F=128, S=256, reps=3)
    print(
        f"{'block':>12} {'static max/mean':>15} {'copies':>6} {'original ms':>11} "
        f"{'moonplan ms':>11} {'static ms':>9} {'moon/orig':>9} {'moon/static':>11}"
    )
    rows = []
    for kind in ("mixtral", "deepseek_v3"):
        got = run_ranks(_rank, 2, kind, cfg, timeout=900)[0]
        o, m, s = got["original"], got["moonplan"], got["static"]
        rows.append({"block": kind, **got, **cfg})
        print(
            f"{kind:>12} {got['static_max_over_mean']:>15.3f} {got['copies']:>6} "
            f"{1e3 * o:>11.2f} {1e3 * m:>11.2f} {1e3 * s:>9.2f} {m / o:>9.3f} {m / s:>11.3f}"
        )
    meta = {"torch": torch.__version__, "ranks": 2, "mode": "forward+backward"}
    write_json(args.out, {**meta, "rows": rows})


if __name__ == "__main__":
    main()
