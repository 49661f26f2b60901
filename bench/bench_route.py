"""Routing benchmark: (token, destination rank) rows sent per record, with and without
affinity, and the time of one ``moonplan.route`` call against one stable sort of the ids.

Every rank draws its own tokens' top-k ids; the counts are all-gathered into an
exact plan (``moonplan.plan``, default slots), and every rank routes its ids.
``rows/rec`` is the sum over ranks of ``Route.sent_rows`` (own rank included)
divided by all records: what a dispatch that sends a token once per destination
rank moves, relative to per-record dispatch (1.0). ``plain`` (the default,
``affinity=False``) and ``affinity`` (``affinity=True``) route the same ids under the
same plan; ``saved`` is affinity's share of plain's rows it saves; ``split`` is the
number of (expert, rank) cells beyond one per expert in the plan (how much
splitting affinity can work with). ``ms`` is the median time of one call on rank 0
(CPU, one thread) and of one stable ``torch.sort`` of its ``S*K`` ids (int64), the
three called alternately in the same run; ``/sort`` are the ratios to the sort.

Scenarios (homes are contiguous: rank ``r`` owns experts ``[r*E/R, (r+1)*E/R)``):

* ``uniform``: each token picks K distinct experts uniformly at random.
* ``group-limited``: experts in 8 groups of E/8 (one group per rank when R = 8);
  a token scores its experts (Gumbel noise), keeps the 4 groups with the best
  top-2 sum and takes its top-K inside them (DeepSeek-V3's routing shape).
* ``lognormal-1`` / ``lognormal-2``: distinct experts drawn by a lognormal
  popularity (sigma 1 or 2): hot experts, so exact plans split them.

    python bench/bench_route.py                # the table, JSON to bench/results/route.json
    python bench/bench_route.py --quick        # fewer tokens (CI smoke)
"""

from __future__ import annotations

import os
import statistics
import time
import zlib
from typing import Any

import torch
from _common import TextTable, bench_parser, result_path, write_json

import moonplan
from moonplan.traces import popularity, sample_topk

SCENARIOS = ["uniform", "group-limited", "lognormal-1", "lognormal-2"]
CONFIGS = [(8, 64, 4096, 8), (8, 256, 4096, 8), (64, 256, 1024, 8), (64, 896, 8192, 8)]
"""(R, E, S tokens per rank, K); the last is the planner's reference shape."""
QUICK = [(8, 64, 512, 8)]


def group_limited(E: int, S: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """``[S, K]`` ids: top-K of a token's scores inside its 4 best of 8 expert groups."""
    G, keep = 8, 4
    score_SE = -torch.log(-torch.log(torch.rand(S, E, generator=gen)))  # Gumbel
    group_SG = score_SE.view(S, G, E // G).topk(2, dim=2).values.sum(2)
    best_SG = group_SG.topk(keep, dim=1).indices
    mask_SG = torch.zeros(S, G, dtype=torch.bool).scatter_(1, best_SG, True)
    masked_SE = score_SE.masked_fill(~mask_SG.repeat_interleave(E // G, 1), float("-inf"))
    return masked_SE.topk(K, dim=1).indices


def draw_ids(scenario: str, R: int, E: int, S: int, K: int, seed: int) -> list[torch.Tensor]:
    """Every rank's ``[S, K]`` top-k ids for one step of ``scenario``."""
    gen = torch.Generator().manual_seed(seed)
    if scenario == "group-limited":
        return [group_limited(E, S, K, gen) for _ in range(R)]
    family, sigma = (
        ("uniform", 1.0) if scenario == "uniform" else ("lognormal", float(scenario[-1]))
    )
    pop_E = popularity(family, E, sigma=sigma, generator=gen)
    return [sample_topk(pop_E, S, K, gen) for _ in range(R)]


def paired_ms(fns: list[Any], reps: int) -> list[float]:
    """Median wall time in ms of each of ``fns``, called alternately ``reps`` times each
    (load drift on a shared machine hits every version alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [1e3 * statistics.median(t) for t in times]


def one(scenario: str, R: int, E: int, S: int, K: int, reps: int) -> dict[str, Any]:
    ids = draw_ids(scenario, R, E, S, K, seed=zlib.crc32(f"{scenario} {R} {E} {S} {K}".encode()))
    counts_RE = torch.stack([torch.bincount(x.reshape(-1), minlength=E) for x in ids])
    plan = moonplan.plan(counts_RE)
    records = int(counts_RE.sum())
    rows = {
        name: sum(moonplan.route(plan, s, x, affinity=aff).sent_rows for s, x in enumerate(ids))
        for name, aff in (("affinity", True), ("plain", False))
    }
    flat = ids[0].reshape(-1)
    ms_sort, ms_plain, ms_aff = paired_ms(
        [
            lambda: torch.sort(flat, stable=True),
            lambda: moonplan.route(plan, 0, ids[0]),
            lambda: moonplan.route(plan, 0, ids[0], affinity=True),
        ],
        reps,
    )
    return {
        "scenario": scenario,
        "R": R,
        "E": E,
        "S": S,
        "K": K,
        "records": records,
        "split_cells": int((plan.alloc > 0).sum()) - int((plan.alloc.sum(1) > 0).sum()),
        "rows_per_record_affinity": rows["affinity"] / records,
        "rows_per_record_plain": rows["plain"] / records,
        "rows_saved": 1 - rows["affinity"] / rows["plain"],
        "sort_ms": ms_sort,
        "route_ms_affinity": ms_aff,
        "route_ms_plain": ms_plain,
        "plain_over_sort": ms_plain / ms_sort,
        "affinity_over_sort": ms_aff / ms_sort,
        "route_time_ratio": ms_aff / ms_plain,
    }


TABLE = TextTable(
    "{scenario:>13} {R:>3} {E:>4} {S:>5} {K:>2} {split_cells:>5} {rows_per_record_plain:>9.3f} "
    "{rows_per_record_affinity:>8.3f} {saved_pct:>7.2f} {sort_ms:>7.2f} {route_ms_plain:>8.2f} "
    "{route_ms_affinity:>6.2f} {plain_over_sort:>11.2f} {affinity_over_sort:>9.2f} "
    "{route_time_ratio:>9.2f}",
    "scenario|R|E|S|K|split|rows/rec|aff|saved %|sort ms|plain ms|aff ms|plain/sort|aff/sort|"
    "aff/plain",
)


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--out", default=result_path("route.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    load = round(os.getloadavg()[0], 1)  # a busy machine makes ratios noisy
    print(f"load {load}")
    print(TABLE.header())
    for R, E, S, K in QUICK if args.quick else CONFIGS:
        for scenario in SCENARIOS:
            r = one(scenario, R, E, S, K, args.reps)
            rows.append(r)
            print(TABLE.row(r, saved_pct=100 * r["rows_saved"]), flush=True)
    end = round(os.getloadavg()[0], 1)
    write_json(args.out, {"threads": 1, "load_avg_1min": [load, end], "rows": rows})


if __name__ == "__main__":
    main()
