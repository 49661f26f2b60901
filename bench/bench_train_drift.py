"""Training on drifting routing: ``auto``'s own re-homes against one order, over long windows.

Legend: T the trace's steps (400), R ranks (8), E experts (64); ratios are a window's mean
step time over the force-balanced ideal's, both from the simulator, each step a training
step (its forward and its backward, ``SimConfig.training``).

The shipped real training traces come from a model trained from scratch: its expert
popularity drifts. The acceptance sweep measures their last 32 steps only, where one
re-home (1.4-1.9 ms, a few steps) inside or outside the window moves the mean. This
script measures the same policies over longer windows too, side by side in one run, per
trace and hardware preset:

* ``auto``: ``moonplan-auto`` as the sweep runs it (its decisions charged this project's
  2-core machine's host rates, ``moonplan.baselines.decision_time``), re-homing by rent
  or buy;
* ``auto host/N``: the same with a decision's host rates divided by ``N`` (a faster host,
  or fewer builds): how much of the gap is the decisions' lag;
* ``order@t``: ``moonplan-auto-ordered`` whose one order is fit on the 32 steps before
  step ``t`` and held from the first step (its move not charged: it is made before the
  trace). At ``t = T - 32`` (the sweep's ``auto+order``) it sees the measured steps'
  neighbours; for the window from step 200, ``order@200`` is what one well-timed re-home
  there could get without looking ahead.

Writes ``bench/results/bench_train_drift.json`` and ``.md``.

    OMP_NUM_THREADS=1 python bench/bench_train_drift.py         # 4 traces, h200 and h20, ~1 min
    python bench/bench_train_drift.py --quick                   # one trace, h200
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from _common import bench_parser, markdown_table, result_path, write_report

from moonplan.baselines.registry import PlanUs, make_policy, plan_us_at
from moonplan.simulate.acceptance import AUTO, ORDERED, profile_loads, recorded_options
from moonplan.simulate.model_time import SimConfig, ideal_time, step_time
from moonplan.simulate.models import get_model
from moonplan.simulate.sweep import policy_options
from moonplan.stepcost.hardware import get_hardware
from moonplan.traces.real import real_traces

MODEL = "olmoe-1b-7b"
"""The preset the real traces are timed as (64 experts, top-8, as the traced model)."""
HARDWARE = ("h200-node", "h20-node")
FASTER = (4, 64)
"""Host speed-ups of a decision tried (``auto host/N``)."""
FROM = 200
"""The first step of the long window (the traces' first re-homes come before it)."""


def windows(T: int, measured: int = 32) -> dict[str, tuple[int, int]]:
    """The windows reported: the sweep's measured steps and the long one."""
    return {f"last {measured}": (T - measured, T), f"{FROM}-{T - 1}": (FROM, T)}


def faster(cfg: SimConfig, n: int) -> SimConfig:
    """``cfg`` with ``moonplan-auto``'s decision host rates divided by ``n`` (at every
    ``(R, E)``)."""

    def rate(table: Any) -> dict[str, PlanUs]:
        us = table[AUTO]
        return {**table, AUTO: lambda R, E: plan_us_at(us, R, E) / n}

    return dataclasses.replace(cfg, decide_us=rate(cfg.decide_us), score_us=rate(cfg.score_us))


def policy_seconds(
    counts_TRE: torch.Tensor, hw: str, cfg: SimConfig, name: str, **more: Any
) -> list[float]:
    """Each step's simulated seconds under ``name`` (the sweep's options on a training
    trace, ``more`` added)."""
    T, R, E = counts_TRE.shape
    m, h = get_model(MODEL), get_hardware(hw)
    opts = {**policy_options(h, R, eplb=recorded_options(T, 32)), "stale_slots": True,
            "layers": m.num_moe_layers, **more}  # fmt: skip
    policy = make_policy(name, R, E, **{**opts, "cost": cfg.step_cost(m, h, name, R)})
    return [step_time(policy.step(c), m, h, cfg, None, counts_RE=c).total_s for c in counts_TRE]


def point(name: str, counts_TRE: torch.Tensor, hw: str, fast: tuple[int, ...]) -> dict[str, Any]:
    """Every policy's ratio to the ideal over every window, for one trace and preset."""
    T, R, _ = counts_TRE.shape
    m, h, cfg = get_model(MODEL), get_hardware(hw), SimConfig(training=True)
    ideal = [ideal_time(int(c.sum()), R, m, h, cfg).total_s for c in counts_TRE]
    runs = {"auto": policy_seconds(counts_TRE, hw, cfg, AUTO)}
    for n in fast:
        runs[f"auto host/{n}"] = policy_seconds(counts_TRE, hw, faster(cfg, n), AUTO)
    for t in (FROM, T - 32):
        profile = profile_loads(counts_TRE[: t + 32], 32)  # the 32 steps before t
        runs[f"order@{t}"] = policy_seconds(counts_TRE, hw, cfg, ORDERED, profile=profile)
    ratios = {
        label: {w: sum(s[a:b]) / sum(ideal[a:b]) for w, (a, b) in windows(T).items()}
        for label, s in runs.items()
    }
    return {"trace": name, "hardware": hw, "ratios": ratios}


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="train-l0 on h200-node only")
    ap.add_argument("--out", default=result_path("bench_train_drift.json"))
    args, t0, traces = ap.parse_args(), time.perf_counter(), real_traces(("train",))
    cut = 1 if args.quick else None  # the first trace, preset and speed-up alone
    rows = [
        point(n, traces[n], hw, FASTER[:cut]) for hw in HARDWARE[:cut] for n in sorted(traces)[:cut]
    ]
    labels = list(rows[0]["ratios"])
    wins = list(rows[0]["ratios"][labels[0]])
    head = ["trace", "hardware", "window", *labels]
    lines = [[r["trace"], r["hardware"], w, *[f"{r['ratios'][k][w]:.3f}" for k in labels]]
             for r in rows for w in wins]  # fmt: skip
    md = ["### Training on drifting routing: mean step over the ideal's, per window", "",
          markdown_table(head, lines)]  # fmt: skip
    result = {"date": time.strftime("%Y-%m-%d"), "points": rows,
              "seconds": time.perf_counter() - t0}  # fmt: skip
    write_report(args.out, result, md)


if __name__ == "__main__":
    main()
