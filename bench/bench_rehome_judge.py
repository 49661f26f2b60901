"""The host time of ``balance="auto"``'s own re-home judgement while serving, side by side.

Legend: R ranks (EP size), E experts, S tokens per rank per step, B slots per rank (2, the
runtime's default); a window of 32 steps.

A serving layer judges its own re-home once, when its window first fills, on the host and
inside a step: the step waits (docs/runtime.md, "Re-homing"). The judgement
(``home_choice.judged_order`` against the serving slots, here empty) scores the window's
steps under the current map and under each candidate order with no slot kept; where both
orders (of whole loads and of loads per replica) are faster at once, it also scores each
one's best table step by step, to take the one that serves best once its table is placed.
Per case, on one synthetic window (a fixed lognormal popularity, sigma 2, every step's
records drawn from it), the median of ``--reps`` runs, interleaved:

* ``popular ms``: the judgement of the popular order alone (the serving slots' steps, and
  the order's with no slot kept): what the judgement cost before the order of shares;
* ``judged ms``: ``judged_order`` as it runs (both orders; the best tables only where
  both are faster at once: ``tables``);
* ``tables ms``: the two best tables scored step by step (``home_choice.table_way``),
  what the judgement adds where both orders are faster at once.

Single-threaded torch on this host's CPU (the window's scores run on its device; a GPU
runtime scores them there, and builds its tables on the host). Writes
``bench/results/bench_rehome_judge.json`` and ``.md``.

    OMP_NUM_THREADS=1 python bench/bench_rehome_judge.py        # 4 cases, about 1 min
    python bench/bench_rehome_judge.py --quick                  # 1 small case
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from _common import markdown_table, result_path, timing_parser, write_report

from moonplan.plan.residency.home_choice import (
    candidate_orders,
    judged_order,
    map_way,
    relabelled,
    serving_s,
    table_way,
    window_order,
)
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.stepcost.hardware import get_hardware

CASES = (  # (model, R, S)
    ("olmoe-1b-7b", 8, 64),
    ("olmoe-1b-7b", 8, 4096),
    ("deepseek-v3", 64, 64),
    ("kimi-k3-like", 64, 64),
)
SLOTS, WINDOW, SIGMA = 2, 32, 2.0


def window(E: int, records: int, seed: int = 0) -> torch.Tensor:
    """int64 ``[WINDOW, E]``: ``records`` a step drawn from one lognormal popularity."""
    g = torch.Generator().manual_seed(seed)
    p_E = torch.exp(torch.randn(E, generator=g) * SIGMA)
    draws = [torch.multinomial(p_E, records, replacement=True, generator=g) for _ in range(WINDOW)]
    return torch.stack([d.bincount(minlength=E) for d in draws])


def case(model: str, R: int, S: int, reps: int) -> dict[str, Any]:
    """The three timings of the module docstring for one case (milliseconds)."""
    m = get_model(model)
    cost = SimConfig().step_cost(m, get_hardware("h200-node"), "moonplan-auto", R)
    loads_SE = window(m.num_experts, R * S * m.top_k)
    empty_RB = torch.full((R, SLOTS), -1, dtype=torch.int64)
    orders = candidate_orders(loads_SE, R, SLOTS)
    popular = window_order(loads_SE, R)

    def popular_alone() -> None:
        serving_s(cost, loads_SE, empty_RB)
        if popular is not None:
            map_way(cost, relabelled(loads_SE, popular), R, SLOTS)

    jobs = {
        "popular": popular_alone,
        "judged": lambda: judged_order(cost, loads_SE, R, SLOTS, empty_RB),
        "tables": lambda: [table_way(cost, relabelled(loads_SE, p), R, SLOTS) for p in orders],
    }
    seconds: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(reps):
        for name, job in jobs.items():
            t0 = time.perf_counter()
            job()
            seconds[name].append(time.perf_counter() - t0)
    ms = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in seconds.items()}
    return {"model": model, "ranks": R, "experts": m.num_experts, "tokens": S, **ms,
            "orders": len(orders)}  # fmt: skip


def main() -> None:
    ap = timing_parser(__doc__, reps=3, out=result_path("bench_rehome_judge.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    cases = CASES[:1] if args.quick else CASES
    rows = [case(*c, reps=args.reps) for c in cases]
    lines = [[r["model"], str(r["ranks"]), str(r["experts"]), str(r["tokens"]),
              f"{r['popular_ms']:.0f}", f"{r['judged_ms']:.0f}", f"{r['tables_ms']:.0f}"]
             for r in rows]  # fmt: skip
    md = ["### The serving re-home's judgement, host ms (one thread)", "",
          markdown_table(["model", "R", "E", "S", "popular ms", "judged ms", "tables ms"],
                         lines)]  # fmt: skip
    result = {"date": time.strftime("%Y-%m-%d"), "cases": rows,
              "seconds": time.perf_counter() - t0}  # fmt: skip
    write_report(args.out, result, md)


if __name__ == "__main__":
    main()
