"""Planner benchmark: copies, remote experts, resident-slot savings and time of plan + routing.

For each (R, E, S, K) and lognormal sigma it prints copies (moonplan, MoonEP
greedy, lower bound), the most remote experts on a rank, new copies per step
with ``previous=`` on a slowly drifting trace (AR(1) rho = 0.999; ``new%`` is
their share of the greedy's copies per step, which re-copies every step; ``fast%``
is that share under rho = 0.99), and the time of ``plan`` + ``route`` for one
rank, both with default arguments, as a ratio to one stable ``torch.sort`` of that
rank's ``S*K`` expert ids (int64), measured interleaved in the same run (the median
of the paired ratios; the bar: at most 2x at (64, 896, 8192, 8), one thread).

A second table times ``policy="auto"`` (every candidate built and scored by a
``StepCost``) against ``policy="exact"`` on the same counts, interleaved, with
the previous step's plan as ``previous=`` (a drifting trace, slots=2): which
candidate was chosen, planner runs, the predicted step time of the choice and
of exact balance, and the planning-time ratio auto/exact. Before it, the mean
copies of the ``bounded-<eps>`` candidates against exact. Writes JSON (``--out``).

    python bench/bench_plan.py                 # all configurations
    python bench/bench_plan.py --quick         # small configurations only (CI smoke)
    python bench/bench_plan.py --auto-only     # only the bounded-copies and auto-vs-exact tables
    python bench/bench_plan.py --reference     # only the first table at (64, 896, 8192, 8)
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
from _common import TextTable, median_ms, result_path, time_interleaved, timing_parser, write_json

import moonplan
from moonplan.baselines import copies_lower_bound, moonep_greedy_alloc, replica_count
from moonplan.plan.plan_time import plan_time
from moonplan.stepcost import StepCost
from moonplan.traces import (
    DriftingTrace,
    counts_for_ranks,
    generate_counts,
    popularity,
    sample_topk,
)

REFERENCE = (64, 896, 8192, 8)
"""(R, E, S, K) of the CPU bar: plan + route at most 2x one stable sort of the ids."""
CONFIGS = [(8, 256, 4096, 8), REFERENCE, (64, 896, 8192, 16), (256, 896, 2048, 16)]
QUICK = [(8, 64, 512, 4), (16, 128, 256, 8)]
SIGMAS = [0.5, 1.0, 2.0]
RHOS = [0.999, 0.99]  # AR(1) drift of log-popularity per step: slow, fast
AUTO_CONFIGS = [(8, 64, 512, 4), (8, 256, 4096, 8), (64, 896, 8192, 8)]
COSTS = [("h200-node", "deepseek-v3"), ("h200-multinode", "deepseek-v3")]


def one_step(
    R: int, E: int, S: int, K: int, sigma: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts ``[R, E]`` and rank 0's ``ids [S, K]`` (consistent with ``counts[0]``)."""
    gen = torch.Generator().manual_seed(seed)
    pop_E = popularity("lognormal", E, sigma=sigma, generator=gen)
    ids_SK = sample_topk(pop_E, S, K, gen)
    counts_RE = counts_for_ranks(pop_E, [S] * R, K, gen)
    counts_RE[0] = torch.bincount(ids_SK.reshape(-1), minlength=E)
    return counts_RE, ids_SK


def time_ratio(counts_RE: torch.Tensor, ids_SK: torch.Tensor, reps: int) -> dict[str, float]:
    """Median milliseconds of plan+route (default arguments) and of one stable sort,
    interleaved; ``ratio``: the median of each plan+route's time over the sort's just
    before it (pairs see the same load on a shared machine)."""
    flat = ids_SK.reshape(-1)
    sort_s, plan_s = time_interleaved(
        lambda: torch.sort(flat, stable=True),
        lambda: moonplan.route(moonplan.plan(counts_RE), 0, ids_SK),
        reps,
        warmup=10,  # steady state: the allocator has settled (no page faults)
    )
    out = median_ms({"plan_route": plan_s, "sort": sort_s})
    paired = statistics.median(p / q for p, q in zip(plan_s, sort_s, strict=True))
    return {**out, "ratio": paired}


def resident_savings(
    R: int, E: int, S: int, K: int, sigma: float, rho: float, steps: int
) -> dict[str, float]:
    """New copies per step with ``previous=`` vs the greedy's copies per step (drifting trace)."""
    trace = DriftingTrace(R, E, S, K, sigma=sigma, rho=rho, seed=1)
    prev, new, greedy = None, [], []
    for t in range(steps):
        counts_RE = trace.step()
        p = moonplan.plan(counts_RE, previous=prev)
        if t >= 2:  # steady state: the first plans fill empty slots
            new.append(p.new_copies())
            greedy.append(replica_count(moonep_greedy_alloc(counts_RE)))
        prev = p
    n, g = statistics.mean(new), statistics.mean(greedy)
    tag = f"rho{rho}"
    return {
        f"new_per_step_{tag}": n,
        f"greedy_per_step_{tag}": g,
        f"new_over_greedy_{tag}": n / g if g else 0.0,
    }


def run(
    configs: list[tuple[int, int, int, int]], sigmas: list[float], reps: int, steps: int
) -> list[dict[str, Any]]:
    rows = []
    for R, E, S, K in configs:
        for sigma in sigmas:
            counts_RE, ids_SK = one_step(R, E, S, K, sigma, seed=0)
            p = moonplan.plan(counts_RE)
            moonplan.check_plan(p, counts_RE)
            row: dict[str, Any] = {
                "R": R,
                "E": E,
                "S": S,
                "K": K,
                "sigma": sigma,
                "copies": p.copies(),
                "greedy_copies": replica_count(moonep_greedy_alloc(counts_RE)),
                "lower_bound": copies_lower_bound(counts_RE),
                "max_remote": int(p.remote_experts().max()),
                "bound": p.max_local,
                "static_max_over_mean": p.summary()["static_max_over_mean"],
            }
            for rho in RHOS:
                row.update(resident_savings(R, E, S, K, sigma, rho, steps))
            row.update(time_ratio(counts_RE, ids_SK, reps))
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def bounded_copies(seeds: int = 20) -> list[dict[str, Any]]:
    """Mean copies of exact and the bounded candidates (EP8, 64 experts, 2048 tokens, top-8)."""
    names = ["exact", "bounded-0.05", "bounded-0.1", "bounded-0.25"]
    print(f"{'sigma':>5} " + " ".join(f"{n:>12}" for n in names) + f" {'more than exact':>15}")
    rows = []
    for sigma in (0.5, 1.0, 2.0):
        copies: dict[str, list[int]] = {n: [] for n in names}
        for seed in range(seeds):
            c = generate_counts(
                "lognormal", ranks=8, experts=64, tokens=2048, topk=8, seed=seed, sigma=sigma
            )
            for n in names:
                copies[n].append(moonplan.plan(c, policy=n).copies())
        exact = copies["exact"]
        more = sum(b > e for n in names[1:] for b, e in zip(copies[n], exact, strict=True))
        row = {"sigma": sigma, "more_than_exact": more}
        row.update({n: statistics.mean(v) for n, v in copies.items()})
        rows.append(row)
        print(f"{sigma:>5} " + " ".join(f"{row[n]:>12.2f}" for n in names) + f" {more:>15}")
    return rows


def auto_vs_exact(
    R: int, E: int, S: int, K: int, sigma: float, hw: str, model: str, reps: int
) -> dict[str, Any]:
    """Median planning seconds of ``policy="auto"`` and ``"exact"``, interleaved (slots=2)."""
    cost = StepCost.from_hardware(hw, model)
    trace = DriftingTrace(R, E, S, K, sigma=sigma, rho=0.99, seed=2)
    prev_a = prev_e = None
    auto_s, exact_s, chosen = [], [], []
    for i in range(reps + 2):
        counts_RE = trace.step()
        t0 = time.perf_counter()
        a = moonplan.plan(counts_RE, slots=2, previous=prev_a, policy="auto", cost=cost)
        t1 = time.perf_counter()
        e = moonplan.plan(counts_RE, slots=2, previous=prev_e)
        t2 = time.perf_counter()
        if i >= 2:  # warm-up
            auto_s.append(t1 - t0)
            exact_s.append(t2 - t1)
            chosen.append(a)
        prev_a, prev_e = a, e
    last = chosen[-1]
    exact_pred = plan_time(cost, moonplan.plan(last.counts, slots=2), planned=1).total_s
    names = [p.policy for p in chosen]
    return {
        "R": R,
        "E": E,
        "S": S,
        "K": K,
        "sigma": sigma,
        "hardware": hw,
        "model": model,
        "chosen": max(set(names), key=names.count),
        "planned": statistics.mean(p.planned for p in chosen),
        "auto_pred_us": last.predicted[last.policy] * 1e6,
        "exact_pred_us": exact_pred * 1e6,
        **median_ms({"auto": auto_s, "exact": exact_s}),
        "auto_over_exact": statistics.median(auto_s) / statistics.median(exact_s),
    }


AUTO_TABLE = TextTable(
    "{R:>4} {E:>4} {S:>5} {K:>3} {sigma:>4} {hardware:>14} {chosen:>13} {planned:>4.1f} "
    "{auto_pred_us:>8.0f} {exact_pred_us:>8.0f} {auto_ms:>8.2f} {exact_ms:>8.2f} "
    "{auto_over_exact:>5.2f}",
    "R|E|S|K|sig|hardware|chosen|runs|pred us|exact us|auto ms|exact ms|ratio",
)


def run_auto(
    configs: list[tuple[int, int, int, int]], sigmas: list[float], reps: int
) -> list[dict[str, Any]]:
    print(AUTO_TABLE.header())
    rows = []
    for R, E, S, K in configs:
        for sigma in sigmas:
            for hw, model in COSTS:
                row = auto_vs_exact(R, E, S, K, sigma, hw, model, reps)
                rows.append(row)
                print(AUTO_TABLE.row(row), flush=True)
    return rows


TABLE = TextTable(
    "{R:>4} {E:>4} {S:>5} {K:>3} {sigma:>4} {static_max_over_mean:>6.2f} {copies:>6} "
    "{greedy_copies:>6} {lower_bound:>5} {remote:>9} {new_step:>8.1f} {greedy_step:>11.1f} "
    "{new_pct:>5.1f} {fast_pct:>5.1f} {plan_route_ms:>13.2f} {sort_ms:>7.2f} {ratio:>5.2f}",
    "R|E|S|K|sig|static|copies|greedy|lower|remote|new/step|greedy/step|new%|fast%|"
    "plan+route ms|sort ms|ratio",
)


def format_row(r: dict[str, Any]) -> str:
    return TABLE.row(
        r,
        remote=f"{r['max_remote']}/{r['bound']}",
        new_step=r["new_per_step_rho0.999"],
        greedy_step=r["greedy_per_step_rho0.999"],
        new_pct=100 * r["new_over_greedy_rho0.999"],
        fast_pct=100 * r["new_over_greedy_rho0.99"],
    )


def main() -> None:
    ap = timing_parser(__doc__, reps=101, out=result_path("bench_plan.json"))
    ap.add_argument("--steps", type=int, default=12, help="drifting-trace steps (default 12)")
    ap.add_argument("--auto-only", action="store_true", help="only the auto-vs-exact table")
    ap.add_argument(
        "--reference", action="store_true", help="only the first table, at the reference shape"
    )
    args = ap.parse_args()
    load = round(os.getloadavg()[0], 1)  # a busy machine makes ratios noisy
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {load}")
    configs = QUICK if args.quick else CONFIGS
    rows: list[dict[str, Any]] = []
    if args.reference:
        configs = [REFERENCE]
    if not args.auto_only:
        print(TABLE.header())
        rows = run(configs, SIGMAS, args.reps, args.steps)
    bounded, auto = [], []
    if not args.reference:
        bounded = bounded_copies(5 if args.quick else 20)
        auto = run_auto(QUICK if args.quick else AUTO_CONFIGS, SIGMAS, args.reps)
    write_json(
        args.out,
        {
            "torch": torch.__version__,
            "load_avg_1min": [load, round(os.getloadavg()[0], 1)],  # at the start and the end
            "rows": rows,
            "bounded": bounded,
            "auto": auto,
        },
    )


if __name__ == "__main__":
    main()
