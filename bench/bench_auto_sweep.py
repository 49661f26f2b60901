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
   and auto's choices; ``moonplan-auto`` chooses ahead (the search off the critical
   path, its excess over the step charged), ``moonplan-auto-inline`` (the search on the
   critical path) and ``moonplan-refresh`` (resident slots refilled in the background,
   modelled only: not in the runtime) run beside it on the same traces, not counted;
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
    python bench/bench_auto_sweep.py --paths --out ...  # CPU time of auto's paths
    python bench/bench_auto_sweep.py --horizons 1,2,4,8,16 --out ...  # the horizon study:
        # auto on HORIZON_GRID (8 measured steps) per StepCost.horizon, peers run once
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import write_report

from moonplan.cost import ModelPreset
from moonplan.plan.api import plan as moonplan_plan
from moonplan.plan.choose import Inputs, build, choose
from moonplan.plan.screen import lower_bound
from moonplan.plan.search import search
from moonplan.simulate.acceptance import (
    AUTO,
    CLASSES,
    EPLB_MODELS,
    IDEAL_BAR,
    IDEAL_POINT,
    INLINE,
    PEER_BAR,
    PEERS,
    REFRESH,
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
from moonplan.simulate.workload import drifting_counts
from moonplan.stepcost import Hardware, StepCost
from moonplan.stepcost.hardware import get_hardware
from moonplan.stepcost.step_cost import DEFAULT_HORIZON
from moonplan.traces.real import KINDS, real_traces

ROOT = Path(__file__).resolve().parents[1]
QUICK = AcceptanceGrid(models=("deepseek-v3",), hardware=("h200-node", "h200-multinode"),
                       ranks=(8, 16), sigmas=(0.0, 2.0), tokens=(16, 1024, 16384))  # fmt: skip
HORIZON_GRID = AcceptanceGrid(models=("deepseek-v3", "kimi-k3-like"),
                              hardware=("h200-node", "h20-node", "h200-multinode"),
                              ranks=(8, 16, 64), sigmas=(1.0, 2.0), tokens=(64, 1024, 4096),
                              steps=8)  # fmt: skip
"""Where the horizon matters (skewed routing, decode to prefill sizes), measured longer."""
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
         "moonplan-resident": "resident", "moonplan-auto": "auto", INLINE: "inline",
         REFRESH: "refresh"}  # fmt: skip


def table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])


def point_lines(rows: list[dict[str, Any]]) -> list[list[str]]:
    return [
        [r["model"], r["hardware"], str(r["ranks"]), f"{r['sigma']:g}", str(r["tokens"]),
         f"{r['vs_peers']:.3f}", SHORT.get(r["best_peer"], r["best_peer"]),
         f"{r['vs_ideal']:.3f}", choices(r["choices"]), f"{r['phases']['plan_us']:.0f}",
         f"{r['phases']['prefetch_exposed_us']:.0f}", f"{r['us'][AUTO]:.0f}",
         f"{r['vs_peers_chosen_only']:.3f}", f"{r['background_plan']:.2f}",
         f"{r['background_wait_us']:.0f}", _ratio(r, "vs_peers_inline"),
         _ratio(r, "vs_peers_refresh")]
        for r in rows
    ]  # fmt: skip


def _ratio(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.3f}" if key in r else "-"


POINT_HEADER = ["model", "hardware", "EP", "sigma", "S", "auto / best peer", "best peer",
                "auto / ideal", "auto chose", "plan us", "exposed prefetch us",
                "auto us", "auto / best peer, chosen candidate planned only",
                "background search (constructions)", "background wait us",
                "inline / best peer", "refresh / best peer"]  # fmt: skip


def choices(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]))


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Worst vs-peers per (model, hardware), and auto's choices over all measured steps."""
    out = []
    for key in dict.fromkeys((r["model"], r["hardware"]) for r in rows):
        at = [r for r in rows if (r["model"], r["hardware"]) == key]
        bad = sum(r["vs_peers"] > PEER_BAR for r in at)
        bad_chosen = sum(r["vs_peers_chosen_only"] > PEER_BAR for r in at)
        bad_inline = sum(r.get("vs_peers_inline", 0.0) > PEER_BAR for r in at)
        top = max(at, key=lambda r: r["vs_peers"])
        out.append([*key, str(len(at)), str(bad), f"{top['vs_peers']:.3f}",
                    f"EP{top['ranks']} sigma {top['sigma']:g} S={top['tokens']}",
                    str(bad_chosen), str(bad_inline)])  # fmt: skip
    total: Counter[str] = Counter()
    for r in rows:
        total.update(r["choices"])
    head = ["model", "hardware", "points", "above bar", "worst auto / best peer", "at",
            "above bar, chosen candidate planned only", "above bar, inline"]  # fmt: skip
    return [table(head, out), "", f"auto's choices over all measured steps: {choices(total)}",
            "", *by_tokens(rows)]  # fmt: skip


def by_tokens(rows: list[dict[str, Any]]) -> list[str]:
    """Per tokens per rank: points within the bar (ahead, inline), worst ratio, auto's mean
    planning charge and background search a step."""
    sizes = sorted({r["tokens"] for r in rows})
    at = {S: [r for r in rows if r["tokens"] == S] for S in sizes}

    def line(label: str, f: Any) -> list[str]:
        return [label, *(f(at[S]) for S in sizes)]

    def within(key: str) -> Any:
        return lambda rs: f"{sum(r.get(key, 9.0) <= PEER_BAR for r in rs)} of {len(rs)}"

    def mean(f: Any) -> Any:
        return lambda rs: f"{sum(f(r) for r in rs) / len(rs):.0f}"

    lines = [
        line("within 1.01x the best peer (ahead)", within("vs_peers")),
        line("within 1.01x, inline", within("vs_peers_inline")),
        line("within 1.01x, chosen candidate planned only", within("vs_peers_chosen_only")),
        line("refresh within 1.01x (not counted)", within("vs_peers_refresh")),
        line("worst auto / best peer", lambda rs: f"{max(r['vs_peers'] for r in rs):.2f}"),
        line("auto's planning charge per step, us", mean(lambda r: r["phases"]["plan_us"])),
        line("of which background wait, us", mean(lambda r: r["background_wait_us"])),
        line(
            "background search per step, constructions (mean)",
            lambda rs: f"{sum(r['background_plan'] for r in rs) / len(rs):.2f}",
        ),
        line(
            "searches cut to fit their work budget",
            lambda rs: (
                f"{sum(r.get('cut_searches', 0) for r in rs)} of "
                f"{sum(r.get('searches', 0) for r in rs)}"
            ),
        ),
        line(
            "measured steps beside a search with a lag above 1",
            lambda rs: (
                f"{sum(r.get('lagged_steps', 0) for r in rs)} of "
                f"{sum(sum(r['choices'].values()) for r in rs)}"
            ),
        ),
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
    policies = (*PEERS, AUTO)
    rows = run_recorded(real_traces(kinds), REAL_MODEL, REAL_HARDWARE, cfg, policies,
                        progress=ProgressBar())  # fmt: skip
    head = ["trace", "hardware", "tokens/rank", *[policy_label(p) for p in policies]]
    md = [f"### The shipped real traces ({len(rows)} points: {REAL_MODEL} on "
          f"{', '.join(REAL_HARDWARE)}; the last 32 steps measured, {time.time() - t0:.0f} s)",
          "", standings_markdown(rows, policies), "",
          "Each policy's step time over the best of them:", "",
          table(head, recorded_lines(rows, policies)), ""]  # fmt: skip
    return rows, md


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


PATH_CASES = ((8, 16), (8, 4096), (64, 64), (64, 4096))
"""``(EP, tokens per rank)`` of :func:`path_costs` (DeepSeek-V3, h200-node, sigma 1)."""


def _median_us(fn: Any, repeat: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e6


def path_costs() -> list[dict[str, Any]]:
    """CPU time of each path of ``policy="auto"`` (the code the runtime runs, torch builder),
    on the second step of a drifting trace with the first step's auto plan as ``previous``:
    the whole choice, and its parts (one screen bound, one construction, one score)."""
    return [_path_row(R, S) for R, S in PATH_CASES]


def _path_row(R: int, S: int) -> dict[str, Any]:
    m = get_model("deepseek-v3")
    cost = SimConfig().step_cost(m, get_hardware("h200-node"), AUTO)
    c0, c = drifting_counts(R, m.num_experts, S, m.top_k, sigma=1.0, steps=2, seed=0)
    prev = moonplan_plan(c0, policy="auto", cost=cost, backend="torch")
    inp = Inputs(c, prev.num_slots, 1, prev.slot_expert, prev.flow, "torch", prev.policy)
    p = choose(inp, cost)
    construct_us = _median_us(lambda: build("exact", inp))
    auto_us = _median_us(lambda: choose(inp, cost))
    # the keep path: the same counts again after a full choice (the loads cannot have moved)
    again = Inputs(c, p.num_slots, 1, p.slot_expert, p.flow, "torch", p.policy, p.basis)
    kept = choose(again, cost)
    kept_us = _median_us(lambda: choose(again, cost))
    kept_built_us = _median_us(lambda: build(kept.policy, again))
    search_us = _median_us(lambda: search(inp, cost))
    return {
        "ranks": R, "tokens": S, "picks": p.policy, "runs": p.planned,
        "auto_us": auto_us, "construct_us": construct_us,
        "bound_us": _median_us(lambda: lower_bound(cost, c, 0, prev_RB=inp.prev_RB,
                                                   prev_F3=inp.prev_F3, horizon=8.0)),
        "score_us": _median_us(lambda: cost.plan_time(p, planned=1)),
        "beyond": (auto_us - p.planned * construct_us) / construct_us, "chose": p.chose,
        "kept": kept.basis is not None and kept.basis.kept > 0, "kept_runs": kept.planned,
        "keep_beyond": (kept_us - kept_built_us) / construct_us, "keep_chose": kept.chose,
        "search_us": search_us, "search_us_per_work": search_us / (p.planned + p.chose),
    }  # fmt: skip


def paths_markdown(rows: list[dict[str, Any]]) -> list[str]:
    head = ["EP", "tokens/rank", "auto picks", "runs", "whole choice us", "one bound us",
            "one construction us", "one score us", "beyond runs / construction",
            "charged (chose)", "kept?", "keep beyond / construction", "keep charged",
            "ahead search us", "search us / (runs + chose)"]  # fmt: skip
    lines = [[str(r["ranks"]), str(r["tokens"]), r["picks"], str(r["runs"]),
              f"{r['auto_us']:.0f}", f"{r['bound_us']:.0f}", f"{r['construct_us']:.0f}",
              f"{r['score_us']:.0f}", f"{r['beyond']:.2f}", f"{r['chose']:.2f}",
              "yes" if r["kept"] else "no", f"{r['keep_beyond']:.2f}", f"{r['keep_chose']:.2f}",
              f"{r['search_us']:.0f}", f"{r['search_us_per_work']:.0f}"]
             for r in rows]  # fmt: skip
    return ["### CPU time of auto's paths (median of 15; torch builder)", "",
            "`beyond runs`: the whole choice minus its constructions, over one construction "
            "(what `Plan.chose` must cover); `keep`: the same counts again, the choice kept "
            "(its time minus building the kept candidate); `ahead search`: the choose-ahead "
            "search (`moonplan.plan.search`) of the full choice, and its us per construction "
            "equivalent charged (`--search-us`; `bench/bench_search.py` compares it).", "",
            table(head, lines), ""]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="reduced grid (the CI test's)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/bench_auto_sweep.json"))
    ap.add_argument("--worst", type=int, default=15, help="worst points listed")
    ap.add_argument("--horizons", default="", help="e.g. 1,2,4,8,16: the horizon study instead")
    ap.add_argument("--steps", type=int, default=0, help="measured steps per point (0: grid's)")
    ap.add_argument("--paths", action="store_true", help="time auto's paths instead")
    ap.add_argument(
        "--search-us",
        type=float,
        default=None,
        help="host us a construction, background search (default plan_us)",
    )
    ap.add_argument("--no-real", action="store_true", help="skip the shipped real traces")
    ap.add_argument("--real-only", action="store_true", help="only the shipped real traces")
    args = ap.parse_args()  # fmt: skip
    if args.paths:
        t0 = time.time()
        rows = path_costs()
        write_report(args.out, {"paths": rows, "seconds": time.time() - t0}, paths_markdown(rows))
        return
    if args.horizons:
        t0 = time.time()
        grid = dataclasses.replace(HORIZON_GRID, steps=args.steps or HORIZON_GRID.steps)
        study = horizon_study(grid, [float(h) for h in args.horizons.split(",")])
        result = {"grid": grid.__dict__, "horizons": study, "seconds": time.time() - t0}
        write_report(args.out, result, horizon_markdown(study, grid))
        return
    cfg = SimConfig(search_us=args.search_us)
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
    rows = run_acceptance(grid, cfg, ProgressBar(), (*PEERS, AUTO, INLINE, REFRESH))
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
        f"ideal at {IDEAL_POINT}. Points above a bar: {len(bad)} (auto chooses ahead; the "
        f"inline schedule, same traces: {sum(r['vs_peers_inline'] > PEER_BAR for r in rows)} "
        "above the peer bar).",
        "",
        f"#### Per policy, on the generated grid ({grid_s:.0f} s)",
        "",
        standings_markdown(rows, (*PEERS, AUTO)),
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


@dataclass(frozen=True)
class HorizonConfig(SimConfig):
    """The simulator's configuration, auto's ``StepCost.horizon`` set (it only steers the
    choice: every step is charged in full whatever the horizon)."""

    horizon: float = DEFAULT_HORIZON

    def step_cost(self, model: ModelPreset, hw: Hardware, policy: str = "") -> StepCost:
        return super().step_cost(model, hw, policy).scaled(horizon=self.horizon)


def horizon_study(grid: AcceptanceGrid, horizons: list[float]) -> dict[str, Any]:
    """Auto against the peers at every point of ``grid`` for each horizon (peers run once)."""
    points, by_h = grid.points(), {h: [] for h in horizons}
    bar = ProgressBar()
    for i, (model, hw, R, sigma, S) in enumerate(points):
        bar(i, len(points), f"{model} {hw} EP={R} sigma={sigma:g} S={S}")
        spec = SweepSpec(model=model, hardware=hw, steps=grid.steps, warmup=grid.warmup,
                         rho=grid.rho, seed=grid.seed)  # fmt: skip
        m, h = get_model(model), get_hardware(hw)
        peers = spec_point(spec, m, h, SimConfig(), R, S, sigma, PEERS)
        best = min(r["total_us"] for r in peers)
        for hz in horizons:
            auto = spec_point(spec, m, h, HorizonConfig(horizon=hz), R, S, sigma, (AUTO,))[0]
            by_h[hz].append(auto["total_us"] / best)
    bar(len(points), len(points), "done")
    out = {}
    for hz, ratios in by_h.items():
        r = sorted(ratios)
        out[f"{hz:g}"] = {"points": len(r), "within_bar": sum(x <= PEER_BAR for x in r),
                          "median": r[len(r) // 2], "p90": r[int(0.9 * (len(r) - 1))],
                          "worst": r[-1], "mean": sum(r) / len(r), "ratios": ratios}  # fmt: skip
    return out


def horizon_markdown(study: dict[str, Any], grid: AcceptanceGrid) -> list[str]:
    head = ["horizon", "points within 1.01x", "median", "90th percentile", "worst", "mean"]
    lines = [[hz, f"{v['within_bar']} of {v['points']}", f"{v['median']:.3f}", f"{v['p90']:.3f}",
              f"{v['worst']:.3f}", f"{v['mean']:.3f}"] for hz, v in study.items()]  # fmt: skip
    title = (f"### auto / best peer by StepCost.horizon ({len(grid.points())} points, "
             f"{grid.steps} measured steps after {grid.warmup})")  # fmt: skip
    return [title, "", table(head, lines), ""]


if __name__ == "__main__":
    main()
