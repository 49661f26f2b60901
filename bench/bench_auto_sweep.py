"""Acceptance sweep of ``moonplan-auto`` in the simulator, and serial vs overlapped (``WHY``).

Legend: R ranks (EP size), S tokens per rank, sigma lognormal skew; ``vs peers`` is
moonplan-auto's mean step time over the least of its peers (``acceptance.PEERS``: static EP
linear and round-robin, EPLB as deployed and every 4 steps with its moves charged, the
MoonEP greedy, moonplan exact and resident) on the same trace; ``/ideal`` over the
force-balanced ideal.

Runs, in one process (``moonplan.simulate.acceptance``):

1. every point of models x hardware x EP x sigma x S (``E >= R``; 504 points) and
   prints the worst points, the failures of the bars (auto <= 1.01x the best peer
   everywhere; <= 1.06x the ideal at DeepSeek-V3, h200-node, EP 8, sigma 1, S 4096)
   and auto's choices; ``moonplan-auto`` makes one planner call a step, charged its device
   time by shape (``moonplan.baselines.planner_time``); it is also judged against static
   EP alone (auto <= 1.01x static everywhere);
2. per policy of the peers and auto: the points it wins (the best of them; ties count for
   each) and its worst and geometric-mean ratio to the best (``acceptance.standings``);
3. the same on the shipped real traces (``moonplan.traces.real``: 12 traces of a trained
   model, 8 ranks, timed as OLMoE-1B-7B on the three hardware presets: 36 points,
   ``acceptance.run_recorded``);
4. the reference settings (DeepSeek-V3: EP 8 decode and 4096 tokens, EP 64) with the
   serial schedule (fetch, then dispatch: the old one) and the overlapped one side by
   side: step time / ideal per policy, and moonplan's prefetch (total and exposed).

Writes ``bench/results/bench_auto_sweep.json`` and ``.md``.

    OMP_NUM_THREADS=1 python bench/bench_auto_sweep.py          # everything (docs/simulator.md)
    python bench/bench_auto_sweep.py --quick    # 24 points, the real traces' decode only
    python bench/bench_auto_sweep.py --no-real  # the generated grid only
    python bench/bench_auto_sweep.py --steps 8 --no-real      # a shorter look
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _common import markdown_table as table
from _common import write_report

from moonplan.simulate.acceptance import (
    AUTO,
    CLASSES,
    EPLB_MODELS,
    IDEAL_BAR,
    IDEAL_POINT,
    ORDERED,
    PEER_BAR,
    PEERS,
    AcceptanceGrid,
    classify,
    failures,
    run_acceptance,
    run_recorded,
    standings,
    worst,
)
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.simulate.progress import ProgressBar
from moonplan.simulate.report import label as policy_label
from moonplan.simulate.sweep import SweepSpec, spec_point
from moonplan.stepcost.hardware import get_hardware
from moonplan.traces.real import KINDS, real_traces

ROOT = Path(__file__).resolve().parents[1]
QUICK = AcceptanceGrid(models=("deepseek-v3",), hardware=("h200-node", "h200-multinode"),
                       ranks=(8, 16), sigmas=(0.0, 2.0), tokens=(16, 1024, 16384))  # fmt: skip
WHY_POLICIES = ("static-linear", "eplb", "eplb-fast", "moonep-greedy", "moonplan",
                "moonplan-resident", AUTO)  # fmt: skip
REAL_MODEL = "olmoe-1b-7b"
"""The model preset the real traces are timed as (64 experts, top-8, as the traced model)."""
REAL_HARDWARE = ("h200-node", "h20-node", "h200-multinode")
WHY = (  # (label, hardware, EP, sigma, tokens per rank)
    ("EP8 decode S=16", "h200-node", 8, 1.0, 16),
    ("EP8 decode S=128", "h200-node", 8, 1.0, 128),
    ("EP8 S=4096 sigma 0", "h200-node", 8, 0.0, 4096),
    ("EP8 S=4096 sigma 1", "h200-node", 8, 1.0, 4096),
    ("EP64 multinode S=4096 sigma 1", "h200-multinode", 64, 1.0, 4096),
)
SHORT = {"static-linear": "static", "static-round-robin": "rr", "moonep-greedy": "greedy",
         "moonplan-resident": "resident", "moonplan-auto": "auto"}  # fmt: skip


def point_lines(rows: list[dict[str, Any]]) -> list[list[str]]:
    return [
        [r["model"], r["hardware"], str(r["ranks"]), f"{r['sigma']:g}", str(r["tokens"]),
         f"{r['vs_peers']:.3f}", SHORT.get(r["best_peer"], r["best_peer"]),
         f"{r['vs_ideal']:.3f}", choices(r["choices"]), f"{r['phases']['plan_us']:.0f}",
         f"{r['phases']['prefetch_exposed_us']:.0f}", f"{r['us'][AUTO]:.0f}",
         f"{r['vs_static']:.3f}", f"{r['vs_peers_unplanned']:.3f}"]
        for r in rows
    ]  # fmt: skip


POINT_HEADER = ["model", "hardware", "EP", "sigma", "S", "auto / best peer", "best peer",
                "auto / ideal", "auto chose", "plan us", "exposed prefetch us",
                "auto us", "auto / static", "auto / best peer, planning not charged"]  # fmt: skip


def choices(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]))


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Worst vs-peers per (model, hardware), and auto's choices over all measured steps."""
    out = []
    for key in dict.fromkeys((r["model"], r["hardware"]) for r in rows):
        at = [r for r in rows if (r["model"], r["hardware"]) == key]
        bad = sum(r["vs_peers"] > PEER_BAR for r in at)
        bad_static = sum(r["vs_static"] > PEER_BAR for r in at)
        bad_unplanned = sum(r["vs_peers_unplanned"] > PEER_BAR for r in at)
        top = max(at, key=lambda r: r["vs_peers"])
        out.append([*key, str(len(at)), str(bad), f"{top['vs_peers']:.3f}",
                    f"EP{top['ranks']} sigma {top['sigma']:g} S={top['tokens']}",
                    str(bad_static), str(bad_unplanned)])  # fmt: skip
    total: Counter[str] = Counter()
    for r in rows:
        total.update(r["choices"])
    head = ["model", "hardware", "points", "above bar", "worst auto / best peer", "at",
            "above 1.01x static", "above bar, planning not charged"]  # fmt: skip
    return [table(head, out), "", f"auto's choices over all measured steps: {choices(total)}",
            "", *by_tokens(rows)]  # fmt: skip


def by_tokens(rows: list[dict[str, Any]]) -> list[str]:
    """Per tokens per rank: points within the bar (peers, static), worst ratio, auto's mean
    planning charge a step."""
    sizes = sorted({r["tokens"] for r in rows})
    at = {S: [r for r in rows if r["tokens"] == S] for S in sizes}

    def line(label: str, f: Any) -> list[str]:
        return [label, *(f(at[S]) for S in sizes)]

    def within(key: str) -> Any:
        return lambda rs: f"{sum(r.get(key, 9.0) <= PEER_BAR for r in rs)} of {len(rs)}"

    def mean(f: Any) -> Any:
        return lambda rs: f"{sum(f(r) for r in rs) / len(rs):.0f}"

    lines = [
        line("within 1.01x the best peer", within("vs_peers")),
        line("within 1.01x static EP", within("vs_static")),
        line("auto+order within 1.01x the best peer", within("ordered_vs_peers")),
        line("auto+order within 1.01x static EP", within("ordered_vs_static")),
        line("within 1.01x, planning not charged", within("vs_peers_unplanned")),
        line("worst auto / best peer", lambda rs: f"{max(r['vs_peers'] for r in rs):.2f}"),
        line("worst auto / static", lambda rs: f"{max(r['vs_static'] for r in rs):.3f}"),
        line("auto's planning charge per step, us", mean(lambda r: r["phases"]["plan_us"])),
    ]
    return [table(["tokens per rank", *map(str, sizes)], lines), ""]


def causes(rows: list[dict[str, Any]]) -> list[str]:
    """Points above the bar by cause (``acceptance.classify``), and at the EPLB-only points
    which EPLB model is the best peer and how far auto is."""
    by: Counter[str] = Counter(classify(r) for r in rows)
    out = [table(["cause", "points"], [[c, str(by[c])] for c in CLASSES]), ""]
    only = [r for r in rows if classify(r) == "eplb"]
    if not only:
        return out
    best: Counter[str] = Counter(r["best_peer"] for r in only)
    ratio = sorted(r["vs_peers"] for r in only)
    out += [f"EPLB-only points: {len(only)} (best peer: "
            f"{', '.join(f'{p} {best[p]}' for p in EPLB_MODELS)}); auto / best EPLB median "
            f"{ratio[len(ratio) // 2]:.3f}, worst {ratio[-1]:.3f}", ""]  # fmt: skip
    return out


def standings_markdown(rows: list[dict[str, Any]], policies: tuple[str, ...]) -> str:
    """Per policy: points won among ``policies``, worst and geometric-mean ratio to the best."""
    got = standings(rows, policies)
    head = ["policy", "points won (of " + str(got[0]["points"]) + ")", "worst / best",
            "geometric mean / best"]  # fmt: skip
    lines = [[policy_label(g["policy"]), str(g["wins"]), f"{g['worst']:.3f}", f"{g['geomean']:.3f}"]
             for g in got]  # fmt: skip
    return table(head, lines)


def recorded_lines(rows: list[dict[str, Any]], policies: tuple[str, ...]) -> list[list[str]]:
    """One line per recorded trace and hardware: each policy's step time / the best's."""
    out = []
    for r in rows:
        best = min(r["us"][p] for p in policies)
        out.append([r["trace"], r["hardware"], f"{r['tokens']:.0f}",
                    *[f"{r['us'][p] / best:.3f}" for p in policies]])  # fmt: skip
    return out


def real_part(cfg: SimConfig, kinds: tuple[str, ...]) -> tuple[list[dict[str, Any]], list[str]]:
    """The real traces' rows and their Markdown (standings and every trace)."""
    t0 = time.time()
    policies = (*PEERS, AUTO, ORDERED)
    rows = run_recorded(real_traces(kinds), REAL_MODEL, REAL_HARDWARE, cfg, policies,
                        progress=ProgressBar())  # fmt: skip
    head = ["trace", "hardware", "tokens/rank", *[policy_label(p) for p in policies]]
    md = [f"### The shipped real traces ({len(rows)} points: {REAL_MODEL} on "
          f"{', '.join(REAL_HARDWARE)}; the last 32 steps measured, {time.time() - t0:.0f} s)",
          "", standings_markdown(rows, policies), "", *real_bars(rows),
          "Each policy's step time over the best of them:", "",
          table(head, recorded_lines(rows, policies)), ""]  # fmt: skip
    return rows, md


def real_bars(rows: list[dict[str, Any]]) -> list[str]:
    """Auto and auto+order against the best peer and the ideal on the real traces."""

    def line(label: str, peers: str, ideal: str) -> list[str]:
        within = sum(r[peers] <= PEER_BAR for r in rows)
        big = [r[ideal] for r in rows if not r["trace"].startswith("decode")]
        return [label, f"{within} of {len(rows)}", f"{max(r[peers] for r in rows):.3f}",
                f"{max(big):.2f}" if big else "-"]  # fmt: skip

    lines = [line("auto", "vs_peers", "vs_ideal")]
    if rows and "ordered_vs_peers" in rows[0]:
        lines.append(line("auto+order", "ordered_vs_peers", "ordered_vs_ideal"))
    head = ["policy", "within 1.01x the best peer", "worst / best peer",
            "worst / ideal, prefill and training"]  # fmt: skip
    return [table(head, lines), ""]


def why(cfg_by_name: dict[str, SimConfig], steps: int, warmup: int) -> list[dict[str, Any]]:
    """Step time / ideal and moonplan's prefetch at the ``WHY`` settings, per schedule."""
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
    ap.add_argument("--steps", type=int, default=0, help="measured steps per point (0: grid's)")
    ap.add_argument("--no-real", action="store_true", help="skip the shipped real traces")
    ap.add_argument("--real-only", action="store_true", help="only the shipped real traces")
    args = ap.parse_args()  # fmt: skip
    cfg = SimConfig()
    kinds = ("decode",) if args.quick else KINDS
    if args.real_only:
        t0 = time.time()
        real, md = real_part(cfg, kinds)
        write_report(args.out, {"date": time.strftime("%Y-%m-%d"), "real": real,
                                "seconds": time.time() - t0}, md)  # fmt: skip
        return
    grid = QUICK if args.quick else AcceptanceGrid()
    if args.steps:
        grid = dataclasses.replace(grid, steps=args.steps)
    t0 = time.time()
    rows = run_acceptance(grid, cfg, ProgressBar(), (*PEERS, AUTO, ORDERED))
    grid_s = time.time() - t0
    real, real_md = ([], []) if args.no_real else real_part(cfg, kinds)
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
        f"ideal at {IDEAL_POINT}; auto <= {PEER_BAR}x static EP at every point. Points above "
        f"the first two: {len(bad)}; above 1.01x static: "
        f"{sum(r['vs_static'] > PEER_BAR for r in rows)}.",
        "",
        f"#### Per policy, on the generated grid ({grid_s:.0f} s)",
        "",
        standings_markdown(rows, (*PEERS, AUTO, ORDERED)),
        "",
        *summary(rows),
        "",
        "#### Points above the bar, by cause",
        "",
        *causes(rows),
        f"#### The {args.worst} worst points (auto / best peer)",
        "",
        table(POINT_HEADER, point_lines(worst(rows, args.worst))),
        "",
        "#### The ideal point",
        "",
        table(POINT_HEADER, point_lines(ideal)) if ideal else "(not in this grid)",
        "",
        "#### Reference settings, serial vs overlapped schedule (DeepSeek-V3)",
        "",
        why_markdown(old_new),
        "",
        *real_md,
    ]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "grid": grid.__dict__,
        "peer_bar": PEER_BAR,
        "ideal_bar": IDEAL_BAR,
        "points": rows,
        "failures": bad,
        "why": old_new,
        "real": real,
        "grid_seconds": grid_s,
        "seconds": time.time() - t0,
    }
    write_report(args.out, result, md)


if __name__ == "__main__":
    main()
