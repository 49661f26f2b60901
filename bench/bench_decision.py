"""A slot-placement decision's host time against the work the lag is sized from.

Legend: R ranks, E experts, K experts per token, B slots per rank (2), W the window (32
steps), S tokens per rank per step.

``moonplan-auto`` and the runtime's placer use a decision (``Residency.decide_on``) once
the steps whose predicted time covers its counted work have passed: the builds of the
``resident`` candidate it makes (``residency.target.Builds``), each at
``planner_time.resident_us`` (the device's modelled time, so that reruns are
bit-identical). The runtime runs the decision in numpy on a host thread, and a step that
reaches the lag before it is done waits for the rest (``docs/runtime.md``, the known
stall). This script measures both, side by side, on one window per case:

* ``builds``: the builds the decision counted, and ``bound`` the most it could make,
  ``W * (B + 3) + 3``;
* ``modelled ms``: ``builds * resident_us``, what the lag covers;
* ``host ms``: the median wall time of the same decision here (numpy, one thread);
* ``host / modelled``: how much longer the host takes than the lag assumes.

The window is synthetic: a fixed lognormal popularity (``sigma``) with every step's
records drawn from it, the persistent routing the placement is built for. The serving
slots are empty, so the decision scores every table.

    OMP_NUM_THREADS=1 python bench/bench_decision.py            # 7 cases (about 1 min)
    python bench/bench_decision.py --quick --out /tmp/x.json
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from _common import markdown_table, result_path, timing_parser, write_report

from moonplan.baselines.planner_time import resident_us
from moonplan.plan.residency.refill import Residency
from moonplan.plan.residency.target import Builds
from moonplan.plan.residency.window import WINDOW
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.stepcost.hardware import get_hardware

CASES = (  # model, hardware, R, S, sigma
    ("mixtral-8x7b", "h200-node", 8, 256, 1.0),
    ("olmoe-1b-7b", "h200-node", 8, 256, 1.0),  # the real traces' model
    ("deepseek-v3", "h200-node", 8, 16, 1.0),
    ("deepseek-v3", "h200-node", 8, 4096, 1.0),
    ("deepseek-v3", "h20-node", 8, 256, 2.0),
    ("deepseek-v3", "h200-multinode", 64, 256, 1.0),
    ("deepseek-v3", "h200-multinode", 64, 4096, 1.0),
)
SLOTS = 2


def window(E: int, R: int, S: int, K: int, sigma: float, seed: int = 0) -> list[torch.Tensor]:
    """``W`` steps' counts, int64 ``[R, E]`` each: every rank's ``S * K`` records drawn
    from one fixed lognormal popularity over the experts (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    pop_E = torch.exp(sigma * torch.randn(E, generator=g, dtype=torch.float64))
    out = []
    for _ in range(WINDOW):
        e_N = torch.multinomial(pop_E, S * K, replacement=True, generator=g)
        out.append(torch.bincount(e_N, minlength=E).repeat(R, 1))
    return out


def measure(case: tuple[str, str, int, int, float], reps: int) -> dict[str, Any]:
    """One decision's counted builds, modelled work and host time at ``case``."""
    model, hw, R, S, sigma = case
    m, h = get_model(model), get_hardware(hw)
    cost = SimConfig().step_cost(m, h, "moonplan-auto", R)
    E = m.num_experts
    steps = window(E, R, S, m.top_k, sigma)
    empty_RB = torch.full((R, SLOTS), -1, dtype=torch.int64)
    times, made = [], 0
    for _ in range(reps):
        res = Residency(R, E, SLOTS, cost)
        for c_RE in steps:
            res.observe(c_RE)
        snap, builds = res.snapshot(steps[-1], empty_RB), Builds()
        t0 = time.perf_counter()
        res.decide_on(snap, builds)
        times.append(time.perf_counter() - t0)
        made = builds.made
    build_us = resident_us(R, E, cost.tile_rows)
    host_ms = statistics.median(times) * 1e3
    modelled_ms = made * build_us * 1e-3
    return {"model": model, "hardware": hw, "ranks": R, "experts": E, "tokens": S,
            "sigma": sigma, "builds": made, "bound": WINDOW * (SLOTS + 3) + 3,
            "build_us": build_us, "modelled_ms": modelled_ms, "host_ms": host_ms,
            "host_over_modelled": host_ms / modelled_ms if modelled_ms else None}  # fmt: skip


def main() -> None:
    ap = timing_parser(__doc__, reps=3, out=result_path("bench_decision.json"))
    args = ap.parse_args()
    cases = CASES[:2] if args.quick else CASES
    rows = [measure(c, args.reps) for c in cases]
    header = ["model", "hw", "R", "S", "sigma", "builds", "bound", "modelled ms", "host ms",
              "host / modelled"]  # fmt: skip
    lines = [[r["model"], r["hardware"], str(r["ranks"]), str(r["tokens"]), str(r["sigma"]),
              str(r["builds"]), str(r["bound"]), f"{r['modelled_ms']:.2f}",
              f"{r['host_ms']:.0f}", f"{r['host_over_modelled'] or 0:.0f}x"]
             for r in rows]  # fmt: skip
    md = ["# A decision's host time against its modelled work", "",
          markdown_table(header, lines)]  # fmt: skip
    write_report(args.out, {"rows": rows, "reps": args.reps}, md)


if __name__ == "__main__":
    main()
