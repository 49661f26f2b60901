"""The lean choose-ahead search against today's ``choose`` (CPU, torch builder).

Legend: R ranks (EP size), S tokens per rank; DeepSeek-V3, h200-node, sigma 1, the
second step of a drifting trace with the first step's ``auto`` plan as ``previous``.

For each case, in one run, interleaved call by call (median of ``--reps``):

* ``full``: a full choice. ``choose`` builds every candidate it scores
  (``choose(..., lean=False)``, the code the search ran before
  ``moonplan.plan.search``), ``search`` names the winner from allocations
  (``moonplan.plan.search``), ``lean choose`` is inline ``policy="auto"`` now
  (the lean scores, then the winner built);
* ``keep``: the same counts again after the full choice (the choice is kept):
  ``choose`` builds the kept candidate, ``search`` builds nothing.

``us / work``: the search's microseconds per construction equivalent it charges,
``search_us / (planned + chose)``: what ``bench/bench_auto_sweep.py --search-us``
should be given for this machine. ``construct us``: one ``build("exact")``.

    OMP_NUM_THREADS=1 python bench/bench_search.py [--reps 15] [--out ...]

Writes ``bench/results/bench_search.json`` and ``.md``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import timing_parser, write_report
from bench_auto_sweep import PATH_CASES, table

from moonplan.plan.api import plan as moonplan_plan
from moonplan.plan.choose import Inputs, build, choose
from moonplan.plan.search import search
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.simulate.workload import drifting_counts
from moonplan.stepcost.hardware import get_hardware

ROOT = Path(__file__).resolve().parents[1]
CASES = (*PATH_CASES, (16, 16), (64, 16))
"""``(EP, tokens per rank)``: ``bench_auto_sweep.PATH_CASES`` and EP 16/64 decode."""


def interleaved_us(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median microseconds of each of ``fns``, called in turn ``reps`` times after one
    untimed round (a busy machine slows them alike)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(reps + 1):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            if i:
                times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def case(R: int, S: int, reps: int) -> dict[str, Any]:
    """One row: the full and the keep path of ``(R, S)``."""
    m = get_model("deepseek-v3")
    cost = SimConfig().step_cost(m, get_hardware("h200-node"), "moonplan-auto")
    c0, c = drifting_counts(R, m.num_experts, S, m.top_k, sigma=1.0, steps=2, seed=0)
    prev = moonplan_plan(c0, policy="auto", cost=cost, backend="torch")
    inp = Inputs(c, prev.num_slots, 1, prev.slot_expert, prev.flow, "torch", prev.policy)
    full = interleaved_us({
        "choose": lambda: choose(inp, cost, lean=False),
        "search": lambda: search(inp, cost),
        "lean_choose": lambda: choose(inp, cost),
        "construct": lambda: build("exact", inp),
    }, reps)  # fmt: skip
    found, p = search(inp, cost), choose(inp, cost)
    again = Inputs(c, p.num_slots, 1, p.slot_expert, p.flow, "torch", p.policy, p.basis)
    keep = interleaved_us({
        "choose": lambda: choose(again, cost, lean=False),
        "search": lambda: search(again, cost),
    }, reps)  # fmt: skip
    kept = search(again, cost)
    return {
        "ranks": R, "tokens": S, "picks": found.policy, "planned": found.planned,
        "chose": found.chose, "full": full, "full_ratio": full["choose"] / full["search"],
        "lean_choose_ratio": full["choose"] / full["lean_choose"],
        "us_per_work": full["search"] / (found.planned + found.chose),
        "kept": kept.basis is not None and kept.basis.kept > 0,
        "keep": keep, "keep_ratio": keep["choose"] / keep["search"],
        "keep_us_per_work": keep["search"] / (kept.planned + kept.chose),
    }  # fmt: skip


def markdown(rows: list[dict[str, Any]], reps: int) -> list[str]:
    head = ["EP", "tokens/rank", "picks", "runs + chose", "construct us", "full: choose us",
            "search us", "ratio", "lean choose us", "us / work", "kept?", "keep: choose us",
            "search us", "ratio", "us / work"]  # fmt: skip
    lines = [[str(r["ranks"]), str(r["tokens"]), r["picks"],
              f"{r['planned']} + {r['chose']:.2f}", f"{r['full']['construct']:.0f}",
              f"{r['full']['choose']:.0f}", f"{r['full']['search']:.0f}",
              f"{r['full_ratio']:.2f}x", f"{r['full']['lean_choose']:.0f}",
              f"{r['us_per_work']:.0f}", "yes" if r["kept"] else "no",
              f"{r['keep']['choose']:.0f}", f"{r['keep']['search']:.0f}",
              f"{r['keep_ratio']:.1f}x", f"{r['keep_us_per_work']:.0f}"]
             for r in rows]  # fmt: skip
    return [f"### The choose-ahead search vs today's choose (CPU, median of {reps}, interleaved)",
            "", table(head, lines), "",
            "`choose`: every scored candidate built (the search before `moonplan.plan.search`); "
            "`search`: by name, nothing laid out; `lean choose`: inline auto now (the winner "
            "built); `us / work`: search us over its charged `planned + chose`.", ""]  # fmt: skip


def main() -> None:
    ap = timing_parser(__doc__, reps=15, out=str(ROOT / "bench/results/bench_search.json"))
    args = ap.parse_args()
    t0 = time.time()
    cases = CASES[:2] if args.quick else CASES
    rows = [case(R, S, args.reps) for R, S in cases]
    write_report(args.out, {"rows": rows, "reps": args.reps, "seconds": time.time() - t0},
                 markdown(rows, args.reps))  # fmt: skip


if __name__ == "__main__":
    main()
