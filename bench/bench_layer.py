"""MoonMoE step time against static EP (the same code with planning off), side by side.

Two ranks (fork, gloo) build two layers with the same weights, one balanced by
moonplan and one static (every record on its home rank), and time them in
turn (A B A B ...) in the same processes: forward, and forward + backward.
Routing is uniform or lognormal-skewed (log-popularity added to the router's
logits). Rank 0's barrier-aligned wall time per step is reported; the ratio
moonplan / static is the figure to quote. Writes JSON (``--out``).

    python bench/bench_layer.py               # R=2, H=512, F=1024, E=8, K=2, 2048 tokens/rank
    python bench/bench_layer.py --quick       # small sizes (smoke test)
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from _common import bench_parser, write_json

from moonplan.runtime.routers import softmax_topk
from moonplan.testing.dist import run_ranks


def _layers(cfg: dict, bias: torch.Tensor) -> dict:
    from moonplan import MoonMoE

    E, H, F = cfg["E"], cfg["H"], cfg["F"]
    g = torch.Generator().manual_seed(0)
    w = (
        torch.randn(E, H, generator=g) * 0.02,
        torch.randn(E, 2 * F, H, generator=g) * H**-0.5,
        torch.randn(E, H, F, generator=g) * F**-0.5,
    )
    layers = {}
    for name, balance in (("moonplan", True), ("static", False)):
        holder: dict[str, Any] = {}

        def router(x: torch.Tensor, holder: dict = holder) -> tuple[torch.Tensor, torch.Tensor]:
            return softmax_topk(holder["layer"].router(x) + bias, cfg["K"])

        layer = MoonMoE(H, F, E, cfg["K"], router=router, balance=balance, max_tokens=cfg["S"])
        layer.load_dense(*w)
        holder["layer"] = layer
        layers[name] = layer
    return layers


def _time(layer: Any, x: torch.Tensor, backward: bool) -> float:
    layer.group.barrier()
    t0 = time.perf_counter()
    if backward:
        layer(x).square().mean().backward()
    else:
        with torch.no_grad():
            layer(x)
    layer.group.barrier()
    return time.perf_counter() - t0


def _rank(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(cfg["E"], generator=g) * cfg["sigma"]
    layers = _layers(cfg, bias)
    x = torch.randn(cfg["S"], cfg["H"], generator=torch.Generator().manual_seed(10 + rank))
    out: dict[str, Any] = {}
    for mode in ("forward", "forward+backward"):
        times: dict[str, list[float]] = {"moonplan": [], "static": []}
        for i in range(cfg["reps"] + 2):
            for name, layer in layers.items():
                dt = _time(layer, x, mode != "forward")
                if i >= 2:
                    times[name].append(dt)
        out[mode] = {k: statistics.median(v) for k, v in times.items()}
    s = layers["moonplan"].last_stats
    out["static_max_over_mean"] = s.static_max_over_mean if s else 1.0
    return out


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default="bench/results/bench_layer.json")
    args = ap.parse_args()
    base = {"E": 8, "K": 2, "H": 512, "F": 1024, "S": 2048, "reps": args.reps}
    if args.quick:
        base.update(H=64, F=128, S=256, reps=3)
    rows = []
    print(
        f"{'routing':>10} {'static max/mean':>15} {'mode':>17} {'moonplan ms':>11} "
        f"{'static ms':>9} {'ratio':>6}"
    )
    for routing, sigma in (("uniform", 0.0), ("lognormal", 1.0)):
        cfg = {**base, "sigma": sigma}
        got = run_ranks(_rank, 2, cfg, timeout=900)[0]
        for mode in ("forward", "forward+backward"):
            m, s = got[mode]["moonplan"], got[mode]["static"]
            rows.append(
                {
                    "routing": routing,
                    "sigma": sigma,
                    "mode": mode,
                    "moonplan_s": m,
                    "static_s": s,
                    "ratio": m / s,
                    "static_max_over_mean": got["static_max_over_mean"],
                    **cfg,
                }
            )
            print(
                f"{routing:>10} {got['static_max_over_mean']:>15.3f} {mode:>17} "
                f"{1e3 * m:>11.2f} {1e3 * s:>9.2f} {m / s:>6.3f}"
            )
    write_json(args.out, {"torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
