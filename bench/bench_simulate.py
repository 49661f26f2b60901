"""Simulator benchmark: the tables and figures of ``docs/simulator.md``.

For Mixtral-8x7B, DeepSeek-V3 and the 896-expert Kimi-K3-like model it prints, as
Markdown: the baselines side by side (balancedness per layer and summed over
layers, max/mean, copies, new copies, moved MB, drops), step time relative to the
force-balanced ideal against skew (EP 8 and 64) and against EP size (8 to 512),
the break-even tokens per rank on three clusters, and the DeepSpeed-MoE and
GShard trends. Writes JSON and Markdown to ``bench/results/`` and the PNG
figures to ``docs/figures/`` (needs matplotlib).

    python bench/bench_simulate.py             # everything (several minutes on 2 CPUs)
    python bench/bench_simulate.py --quick     # small smoke run, no figures
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _common import write_report

from moonplan.baselines.compare import compare_policies
from moonplan.baselines.metrics import balancedness
from moonplan.baselines.prehistory import Prehistory
from moonplan.baselines.registry import make_policy, names
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import expert_bytes, get_model
from moonplan.simulate.progress import ProgressBar
from moonplan.simulate.report import break_even_table, sweep_table, trend_table
from moonplan.simulate.sweep import SweepSpec, break_even, sweep
from moonplan.simulate.trends import deepspeed_trend, gshard_trend
from moonplan.simulate.workload import drifting_counts, prehistory
from moonplan.stepcost import StepCost, get_hardware

MODELS = ("mixtral-8x7b", "deepseek-v3", "kimi-k3-like")
HW = "h200-multinode"
EP_SWEEP = (8, 16, 32, 64, 128, 256, 512)
SIGMAS = (0.0, 0.25, 0.5, 1.0, 2.0)
BREAK_EVEN = (("h200-node", 8), ("h20-node", 8), ("h200-multinode", 64))
ROOT = Path(__file__).resolve().parents[1]


def auto_cost(model: str) -> StepCost:
    """The cost model moonplan-auto minimises in the side-by-side tables (on ``HW``)."""
    return SimConfig().step_cost(get_model(model), get_hardware(HW), "moonplan-auto")


def compare_table(model: str, ranks: int, sigma: float, layers: int, steps: int) -> list[dict]:
    """Baselines side by side on ``layers`` independent layers (one trace per layer)."""
    m = get_model(model)
    counts = torch.stack(
        [
            drifting_counts(ranks, m.num_experts, 4096, m.top_k, sigma=sigma, steps=2 * steps,
                            seed=layer, rho=0.99)
            for layer in range(layers)
        ]
    )  # fmt: skip
    law = {"sigma": sigma, "rho": 0.99}

    def before(layer: int, steps_N: torch.Tensor) -> Prehistory:
        """The deployed EPLB's window before each layer's trace, as the sweep draws it."""
        return prehistory(steps_N, ranks=ranks, experts=m.num_experts, tokens=4096,
                          topk=m.top_k, seed=layer, **law)  # fmt: skip

    eplb = SweepSpec().eplb_options()  # its measured steps in the middle of its period
    rows = compare_policies(counts, names(), expert_bytes=expert_bytes(m), warmup=steps,
                            before=before, period=4, window=4, cost=auto_cost(model),
                            **eplb)  # fmt: skip
    return [{"model": model, "ranks": ranks, "sigma": sigma, **r} for r in rows]


def compare_markdown(rows: list[dict]) -> str:
    head = "| policy | bal. layer min | bal. layer mean | bal. summed | max/mean | copies | "
    head += "new copies | moved GB | dropped |\n|---|---|---|---|---|---|---|---|---|"
    lines = [
        f"| {r['policy']} | {r['balancedness_layer_min']:.3f} | {r['balancedness_layer_mean']:.3f}"
        f" | {r['balancedness_summed']:.3f} | {r['max_over_mean']:.2f} | {r['copies']:.0f} | "
        f"{r['new_copies']:.1f} | {r['moved_bytes'] / 1e9:.2f} | {r['dropped_fraction']:.1%} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def figures(out: Path, skew_rows: dict[str, list], ep_rows: dict[str, list]) -> list[str]:
    """Per-rank loads and balancedness of DeepSeek-V3 at EP 8, and the sweep plots."""
    from moonplan.simulate import plots

    m = get_model("deepseek-v3")
    counts = drifting_counts(8, m.num_experts, 4096, m.top_k, sigma=1.0, steps=32, seed=0)
    made = []
    pols = [make_policy(n, 8, m.num_experts, period=8, cost=auto_cost("deepseek-v3"),
                        eplb_window=8, eplb_period=8) for n in names()]  # fmt: skip
    series: dict[str, list[float]] = {p.name: [] for p in pols}
    last = []
    for c in counts:
        last = [p.step(c) for p in pols]
        for s in last:
            series[s.name].append(balancedness(s.load_R))
    title = "DeepSeek-V3, EP 8, sigma 1, last step"
    made.append(plots.plot_rank_loads(last, out / "sim_rank_loads.png", title))
    title = "DeepSeek-V3, EP 8, sigma 1 (persistent 0.996, rho 0.99), EPLB every 8 steps"
    made.append(plots.plot_balancedness(series, out / "sim_balancedness.png", title))
    for model, rows in skew_rows.items():
        made.append(plots.plot_vs_skew(rows, out / f"sim_skew_{model}.png", model))
    for model, rows in ep_rows.items():
        made.append(plots.plot_vs_ep(rows, out / f"sim_ep_{model}.png", model))
    return [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in made]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke configuration")
    ap.add_argument("--out", default=str(ROOT / "bench/results/bench_simulate.json"))
    ap.add_argument("--figures", default=str(ROOT / "docs/figures"))
    args = ap.parse_args()
    quick = args.quick
    models = MODELS[:1] if quick else MODELS
    eps, sigmas = ((8, 16), (0.0, 1.0)) if quick else (EP_SWEEP, SIGMAS)
    grid = (64, 4096) if quick else (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    bar, md, result = ProgressBar(), [], {"date": time.strftime("%Y-%m-%d"), "hardware": HW}
    t0 = time.time()

    result["compare"] = []
    for model in models:
        rows = compare_table(model, 8, 1.0, 2 if quick else 8, 2 if quick else 8)
        result["compare"] += rows
        md += [
            f"### Baselines side by side: {model}, EP 8, sigma 1",
            "",
            compare_markdown(rows),
            "",
        ]

    skew_rows, ep_rows = {}, {}
    for model in models:
        spec = SweepSpec(model=model, hardware=HW, ranks=(8, 64)[: len(eps)], sigmas=sigmas)
        skew_rows[model] = sweep(spec, progress=bar)
        spec = SweepSpec(model=model, hardware=HW, ranks=eps, sigmas=(1.0,))
        ep_rows[model] = sweep(spec, progress=bar)
        md += [f"### {model} on {HW}: step time / ideal vs skew", "",
               sweep_table(skew_rows[model], markdown=True), "",
               f"### {model} on {HW}: step time / ideal vs EP size (sigma 1)", "",
               sweep_table(ep_rows[model], markdown=True), ""]  # fmt: skip
    result["skew"], result["ep"] = skew_rows, ep_rows

    be = []
    for model in models:
        for hw, R in BREAK_EVEN[:1] if quick else BREAK_EVEN:
            be.append(break_even(model, hw, R, 1.0, tokens=grid, progress=bar))
    result["break_even"] = be
    md += ["### Break-even tokens per rank (sigma 1)", "", break_even_table(be, markdown=True), ""]

    ds = deepspeed_trend(gpus=(8, 64) if quick else (8, 16, 32, 64))
    gs = gshard_trend(experts=(128, 256) if quick else (128, 256, 512, 1024, 2048))
    result["trends"] = {"deepspeed": ds, "gshard": gs}
    keys = ["gpus", "experts_per_gpu", "experts_us", "dispatch_combine_us", "moe_layer_us",
            "dense_us", "forward_us", "per_gpu_speedup"]  # fmt: skip
    md += ["### DeepSpeed-MoE trend", "", trend_table(ds, keys, markdown=True), ""]
    keys = ["experts", "dispatch_combine_us", "moe_layer_us", "dense_us", "share"]
    md += ["### GShard trend", "", trend_table(gs, keys, markdown=True), ""]

    if not quick:
        result["figures"] = figures(Path(args.figures), skew_rows, ep_rows)
    result["seconds"] = time.time() - t0
    write_report(args.out, result, md)


if __name__ == "__main__":
    main()
