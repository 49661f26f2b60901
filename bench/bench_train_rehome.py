"""``balance="auto"``'s own re-home in training, in the simulator, side by side.

Legend: R ranks (EP size), S tokens per rank, sigma lognormal skew; ``/ best peer``:
mean step time over the least of the peers (``acceptance.PEERS``) on the same trace.

Generated traces with a persistent part (the acceptance grid's law), run as training:
every step changes the weights, so no slot outlives a step (``stale_slots``), each step
is charged its backward too (``SimConfig.training``), and no
policy sees steps before the trace (a training run starts with none; EPLB as deployed
gets the recorded traces' schedule, ``acceptance.recorded_options``). ``moonplan-auto``
runs twice on each trace: without its own re-homes (``rehome=False``) and with them (the
runtime's default: its decisions' rent or buy, taken after an optimizer step,
``moonplan.core.optimizer_rehome``; each move's link time charged to the next step at
``policies.TRAINING_MOVE_BYTES``).

Writes ``bench/results/bench_train_rehome.json`` and ``.md``.

    OMP_NUM_THREADS=1 python bench/bench_train_rehome.py           # 48 points, ~6 min
    python bench/bench_train_rehome.py --quick                     # 4 points
"""

from __future__ import annotations

import time
from itertools import product
from typing import Any

from _common import bench_parser, result_path, write_report
from _common import markdown_table as table

from moonplan.simulate.acceptance import AUTO, PEERS, AcceptanceGrid, recorded_options
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.simulate.sweep import point_trace, policy_options, simulate_trace
from moonplan.stepcost.hardware import get_hardware

MODELS = ("deepseek-v3", "kimi-k3-like")
HARDWARE = ("h200-node", "h20-node")
RANKS, SIGMAS, TOKENS = (8, 16), (0.5, 1.0, 2.0), (1024, 4096)
WARMUP = 96  # steps before the measured ones: the first window, then 64 more


def point(model: str, hw: str, R: int, sigma: float, S: int) -> dict[str, Any]:
    """Mean step time (us) of the peers and of auto without and with its re-home."""
    grid = AcceptanceGrid(warmup=WARMUP)
    spec, m, h = grid.spec(model, hw), get_model(model), get_hardware(hw)
    counts, _, _ = point_trace(spec, m, R, S, sigma)
    eplb = recorded_options(counts.shape[0], spec.steps)
    opts = {**policy_options(h, R, groups=spec.eplb_groups, slots=spec.slots, eplb=eplb),
            "stale_slots": True}  # fmt: skip
    cfg = SimConfig(training=True)  # each step with its backward
    rows = simulate_trace(counts, m, h, cfg, (*PEERS, AUTO), warmup=spec.warmup,
                          options={**opts, "rehome": True})  # fmt: skip
    us = {r["policy"]: r["total_us"] for r in rows}
    (plain,) = simulate_trace(
        counts, m, h, cfg, (AUTO,), warmup=spec.warmup, options={**opts, "rehome": False}
    )  # the peers ignore it
    us[f"{AUTO} (no re-home)"] = plain["total_us"]
    best = min(us[p] for p in PEERS)
    return {"model": model, "hardware": hw, "ranks": R, "sigma": sigma, "tokens": S,
            "us": us, "best_peer": min(PEERS, key=us.__getitem__),
            "before": us[f"{AUTO} (no re-home)"] / best, "after": us[AUTO] / best}  # fmt: skip


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="4 points (DeepSeek-V3, h200-node)")
    ap.add_argument("--out", default=result_path("bench_train_rehome.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    points = list(product(MODELS, HARDWARE, RANKS, SIGMAS, TOKENS))
    if args.quick:
        points = [p for p in points if p[:2] == ("deepseek-v3", "h200-node") and p[3] != 0.5]
        points = points[:4]
    rows = []
    for i, p in enumerate(points):
        print(f"[{i}/{len(points)}] {p}", flush=True)
        rows.append(point(*p))
    lines = [[r["model"], r["hardware"], str(r["ranks"]), str(r["sigma"]), str(r["tokens"]),
              r["best_peer"], f"{r['before']:.3f}", f"{r['after']:.3f}"] for r in rows]  # fmt: skip
    within = [sum(r[k] <= 1.01 for r in rows) for k in ("before", "after")]
    md = [f"### auto in training, without and with its own re-home ({len(rows)} points)", "",
          f"Within 1.01x the best peer: {within[0]} of {len(rows)} without, {within[1]} with.",
          f"Worst: {max(r['before'] for r in rows):.3f} without, "
          f"{max(r['after'] for r in rows):.3f} with.", "",
          table(["model", "hardware", "EP", "sigma", "S", "best peer", "auto / best peer",
                 "with re-home"], lines)]  # fmt: skip
    result = {"date": time.strftime("%Y-%m-%d"), "points": rows,
              "seconds": time.perf_counter() - t0}  # fmt: skip
    write_report(args.out, result, md)


if __name__ == "__main__":
    main()
