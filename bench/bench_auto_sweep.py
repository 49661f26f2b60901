"""Acceptance sweep of ``moonplan-auto`` in the simulator, and the issue's old-vs-new numbers.

Legend: R ranks (EP size), S tokens per rank, sigma lognormal skew; ``vs peers`` is
moonplan-auto's mean step time over the least of static-linear, EPLB, the MoonEP greedy
and moonplan-resident on the same trace; ``/ideal`` over the force-balanced ideal.

Runs, in one process (``moonplan.simulate.acceptance``):

1. every point of models x hardware x EP x sigma x S (``E >= R``; 504 points) and
   prints the worst points, the failures of the bars (auto <= 1.01x the best peer
   everywhere; <= 1.06x the ideal at DeepSeek-V3, h200-node, EP 8, sigma 1, S 4096)
   and auto's choices;
2. the reference settings (DeepSeek-V3: EP 8 decode and 4096 tokens, EP 64) with the
   serial schedule (fetch, then dispatch: the old one) and the overlapped one side by
   side: step time / ideal per policy, and moonplan's prefetch (total and exposed).

Writes ``bench/results/bench_auto_sweep.json`` and ``.md``.

    python bench/bench_auto_sweep.py            # full grid (tens of minutes on 2 CPUs)
    python bench/bench_auto_sweep.py --quick    # 24 points, a minute
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from moonplan.simulate.acceptance import (
    AUTO,
    IDEAL_BAR,
    IDEAL_POINT,
    PEER_BAR,
    AcceptanceGrid,
    failures,
    run_acceptance,
    worst,
)
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.simulate.progress import ProgressBar
from moonplan.simulate.sweep import SweepSpec, spec_point
from moonplan.stepcost.hardware import get_hardware

ROOT = Path(__file__).resolve().parents[1]
QUICK = AcceptanceGrid(models=("deepseek-v3",), hardware=("h200-node", "h200-multinode"),
                       ranks=(8, 16), sigmas=(0.0, 2.0), tokens=(16, 1024, 16384))  # fmt: skip
WHY_POLICIES = ("static-linear", "eplb", "moonep-greedy", "moonplan", "moonplan-resident", AUTO)
WHY = (  # (label, hardware, EP, sigma, tokens per rank)
    ("EP8 decode S=16", "h200-node", 8, 1.0, 16),
    ("EP8 decode S=128", "h200-node", 8, 1.0, 128),
    ("EP8 S=4096 sigma 0", "h200-node", 8, 0.0, 4096),
    ("EP8 S=4096 sigma 1", "h200-node", 8, 1.0, 4096),
    ("EP64 multinode S=4096 sigma 1", "h200-multinode", 64, 1.0, 4096),
)
SHORT = {"static-linear": "static", "moonep-greedy": "greedy", "moonplan-resident": "resident",
         "moonplan-auto": "auto"}  # fmt: skip


def table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])


def point_lines(rows: list[dict[str, Any]]) -> list[list[str]]:
    return [
        [r["model"], r["hardware"], str(r["ranks"]), f"{r['sigma']:g}", str(r["tokens"]),
         f"{r['vs_peers']:.3f}", SHORT.get(r["best_peer"], r["best_peer"]),
         f"{r['vs_ideal']:.3f}", choices(r["choices"]), f"{r['phases']['plan_us']:.0f}",
         f"{r['phases']['prefetch_exposed_us']:.0f}", f"{r['us'][AUTO]:.0f}",
         f"{r['vs_peers_chosen_only']:.3f}"]
        for r in rows
    ]  # fmt: skip


POINT_HEADER = ["model", "hardware", "EP", "sigma", "S", "auto / best peer", "best peer",
                "auto / ideal", "auto chose", "plan us", "exposed prefetch us",
                "auto us", "auto / best peer, chosen candidate planned only"]  # fmt: skip


def choices(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]))


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Worst vs-peers per (model, hardware), and auto's choices over all measured steps."""
    out = []
    for key in dict.fromkeys((r["model"], r["hardware"]) for r in rows):
        at = [r for r in rows if (r["model"], r["hardware"]) == key]
        bad = sum(r["vs_peers"] > PEER_BAR for r in at)
        bad_chosen = sum(r["vs_peers_chosen_only"] > PEER_BAR for r in at)
        top = max(at, key=lambda r: r["vs_peers"])
        out.append([*key, str(len(at)), str(bad), f"{top['vs_peers']:.3f}",
                    f"EP{top['ranks']} sigma {top['sigma']:g} S={top['tokens']}",
                    str(bad_chosen)])  # fmt: skip
    total: Counter[str] = Counter()
    for r in rows:
        total.update(r["choices"])
    head = ["model", "hardware", "points", "above bar", "worst auto / best peer", "at",
            "above bar, chosen candidate planned only"]  # fmt: skip
    return [table(head, out), "", f"auto's choices over all measured steps: {choices(total)}"]


def why(cfg_by_name: dict[str, SimConfig], steps: int, warmup: int) -> list[dict[str, Any]]:
    """Step time / ideal and moonplan's prefetch at the issue's settings, per schedule."""
    out = []
    for label, hw, R, sigma, S in WHY:
        spec = SweepSpec(model="deepseek-v3", hardware=hw, steps=steps, warmup=warmup)
        m, h = get_model("deepseek-v3"), get_hardware(hw)
        for schedule, cfg in cfg_by_name.items():
            rows = spec_point(spec, m, h, cfg, R, S, sigma, WHY_POLICIES)
            by = {r["policy"]: r for r in rows}
            out.append(
                {
                    "setting": label, "schedule": schedule, "hardware": hw, "ranks": R,
                    "sigma": sigma, "tokens": S, "ideal_us": rows[0]["ideal_us"],
                    "rel_ideal": {p: r["rel_ideal"] for p, r in by.items()},
                    "vs_static": {p: r["total_us"] / by["static-linear"]["total_us"]
                                  for p, r in by.items()},
                    "moonplan_prefetch_us": by["moonplan"]["prefetch_us"],
                    "moonplan_exposed_us": by["moonplan"]["prefetch_exposed_us"],
                    "moonplan_total_us": by["moonplan"]["total_us"],
                    "auto_choices": by[AUTO].get("choices", {}),
                }
            )  # fmt: skip
    return out


def why_markdown(rows: list[dict[str, Any]]) -> str:
    head = ["setting", "schedule", *[f"{SHORT.get(p, p)} /ideal" for p in WHY_POLICIES],
            "moonplan prefetch us (exposed)", "moonplan us"]  # fmt: skip
    lines = [
        [r["setting"], r["schedule"], *[f"{r['rel_ideal'][p]:.3f}" for p in WHY_POLICIES],
         f"{r['moonplan_prefetch_us']:.0f} ({r['moonplan_exposed_us']:.0f})",
         f"{r['moonplan_total_us']:.0f}"]
        for r in rows
    ]  # fmt: skip
    return table(head, lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="reduced grid (the CI test's)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/bench_auto_sweep.json"))
    ap.add_argument("--worst", type=int, default=15, help="worst points listed")
    args = ap.parse_args()
    grid = QUICK if args.quick else AcceptanceGrid()
    t0 = time.time()
    rows = run_acceptance(grid, SimConfig(), progress=ProgressBar())
    bad = failures(rows)
    ideal = [r for r in rows if (r["model"], r["hardware"], r["ranks"], r["sigma"], r["tokens"])
             == IDEAL_POINT]  # fmt: skip
    cfgs = {"serial (old)": SimConfig(overlap_prefetch=False), "overlapped": SimConfig()}
    old_new = why(cfgs, grid.steps, grid.warmup)
    md = [
        f"### moonplan-auto acceptance sweep ({len(rows)} points, {grid.steps} measured steps "
        f"after {grid.warmup})",
        "",
        f"Bars: auto <= {PEER_BAR}x the best peer at every point; auto <= {IDEAL_BAR}x the "
        f"ideal at {IDEAL_POINT}. Points above a bar: {len(bad)}.",
        "",
        *summary(rows),
        "",
        f"#### The {args.worst} worst points (auto / best peer)",
        "",
        table(POINT_HEADER, point_lines(worst(rows, args.worst))),
        "",
        "#### The ideal point",
        "",
        table(POINT_HEADER, point_lines(ideal)) if ideal else "(not in this grid)",
        "",
        "#### Issue 10's settings, serial vs overlapped schedule (DeepSeek-V3)",
        "",
        why_markdown(old_new),
        "",
    ]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "grid": grid.__dict__,
        "peer_bar": PEER_BAR,
        "ideal_bar": IDEAL_BAR,
        "points": rows,
        "failures": bad,
        "why": old_new,
        "seconds": time.time() - t0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {out} and {out.with_suffix('.md')} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
