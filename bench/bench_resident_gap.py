"""How far the ``resident`` candidate's rounds end from the least largest load its holders
allow, on the slot tables ``moonplan-auto`` serves in the simulator.

Legend: R ranks, E experts, M = ceil(E/R) slots per rank that take records, S tokens per
rank, sigma the skew of the lognormal popularity.

For each point (the acceptance grid's trace law: ``moonplan.simulate.acceptance``),
``moonplan-auto`` runs the point's whole trace; on its last step's counts and the slot
table that step leaves (what serves the next), the ``resident`` candidate
(``moonplan.plan.choice.resident``, records: one-row tiles) is built twice: with the
point's cost model, whose rounds stop at the first that did not pay for itself (what
``auto`` runs), and without one, whose rounds run while the largest load falls (at most
``ROUND_LIMIT``). Each build's largest rank load is given over the least largest load
those holders allow (``moonplan.testing.bounds``, a max-flow bound in whole records;
1.000 is the best balance the resident replicas can give without a copy), with the
rounds it ran and what they cost the device (``planner_time.ROUND_US`` each).

    OMP_NUM_THREADS=1 python bench/bench_resident_gap.py           # 6 points (about 20 s)
    OMP_NUM_THREADS=1 python bench/bench_resident_gap.py --quick   # 1 point, a short trace
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from _common import bench_parser, markdown_table, result_path, write_report

from moonplan.baselines.planner_time import ROUND_US
from moonplan.baselines.policies import MoonplanAutoPolicy
from moonplan.baselines.prehistory import step_ranges
from moonplan.baselines.registry import make_policy
from moonplan.plan.choice.resident import holders_torch, resident_torch
from moonplan.plan.home import home_map
from moonplan.simulate.acceptance import AUTO, AcceptanceGrid
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.simulate.sweep import point_trace
from moonplan.stepcost import StepCost
from moonplan.stepcost.hardware import get_hardware
from moonplan.testing.bounds import least_largest_load

POINTS = (  # model, hardware, R, sigma, S
    ("mixtral-8x7b", "h200-node", 8, 2.0, 1024),
    ("mixtral-8x7b", "h200-node", 8, 1.0, 1024),
    ("deepseek-v3", "h200-node", 8, 1.0, 256),
    ("deepseek-v3", "h200-node", 64, 2.0, 1024),
    ("deepseek-v3", "h200-node", 64, 1.0, 64),
    ("deepseek-v3", "h200-node", 64, 0.5, 256),
)
"""Points where ``auto`` serves the ``resident`` plan (the acceptance sweep's choices)."""


def served_last_step(
    point: tuple[str, str, int, float, int], grid: AcceptanceGrid
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int], StepCost]:
    """The trace's last counts (int64 ``[R, E]``), the slot table that step leaves (int64
    ``[R, B]``, what serves the next), ``auto``'s choices over the measured steps, as the
    sweep runs it, and its cost model."""
    model, hw, R, sigma, S = point
    m, h = get_model(model), get_hardware(hw)
    counts, _, before = point_trace(grid.spec(model, hw), m, R, S, sigma)
    cost = SimConfig().step_cost(m, h, AUTO, R)
    policy = make_policy(AUTO, R, m.num_experts, cost=cost, slots=grid.slots,
                         layers=m.num_moe_layers)  # fmt: skip
    assert isinstance(policy, MoonplanAutoPolicy)
    policy.prime(before(step_ranges(policy.steps_before())))
    choices: dict[str, int] = {}
    for t, c_RE in enumerate(counts):
        step = policy.step(c_RE)
        if t >= grid.warmup:
            choices[step.choice] = choices.get(step.choice, 0) + 1
    serving = policy.serving
    assert serving is not None
    return counts[-1], serving.slot_expert.cpu(), choices, cost


def measure(point: tuple[str, str, int, float, int], grid: AcceptanceGrid) -> dict[str, Any]:
    """One point's row: the bound and each round count's largest load over it."""
    t0 = time.perf_counter()
    c_RE, slot_RB, choices, cost = served_last_step(point, grid)
    R, E = c_RE.shape
    home_E = home_map(E, R)
    hold_ER = holders_torch(E, R, slot_RB, home_E)
    holders = [hold_ER[e].nonzero().flatten().tolist() for e in range(E)]
    bound = least_largest_load(c_RE.sum(0).tolist(), holders, R)
    builds = {}
    for rule, model_cost in (("paid", cost), ("falling", None)):
        alloc_ER, rounds = resident_torch(c_RE, slot_RB, home_E, 1, model_cost)
        largest = int(alloc_ER.sum(0).max())
        builds[rule] = {"largest": largest, "over_bound": largest / bound,
                        "rounds": int(rounds), "rounds_us": int(rounds) * ROUND_US}  # fmt: skip
    model, hw, _, sigma, S = point
    return {"model": model, "hardware": hw, "ranks": R, "sigma": sigma, "tokens": S,
            "choices": choices, "mean": int(c_RE.sum()) / R, "bound": bound,
            "builds": builds, "seconds": time.perf_counter() - t0}  # fmt: skip


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="one point, a short trace")
    ap.add_argument("--out", default=result_path("bench_resident_gap.json"))
    args = ap.parse_args()
    grid, points = AcceptanceGrid(), POINTS
    if args.quick:
        grid, points = dataclasses.replace(grid, steps=2, warmup=6), POINTS[:1]
    t0 = time.perf_counter()
    rows = [measure(p, grid) for p in points]
    header = ["model", "hw", "R", "sigma", "S", "auto's choices", "bound / mean",
              "paid / bound", "paid rounds", "paid us", "falling / bound", "falling rounds",
              "falling us"]  # fmt: skip
    lines = [[r["model"], r["hardware"], str(r["ranks"]), str(r["sigma"]), str(r["tokens"]),
              ", ".join(f"{k} {v}" for k, v in sorted(r["choices"].items())),
              f"{r['bound'] / r['mean']:.3f}",
              *[x for rule in ("paid", "falling") for x in (
                  f"{r['builds'][rule]['over_bound']:.3f}", str(r["builds"][rule]["rounds"]),
                  f"{r['builds'][rule]['rounds_us']:.1f}")]] for r in rows]  # fmt: skip
    md = ["# The resident candidate's rounds against the holders' bound", "",
          markdown_table(header, lines)]  # fmt: skip
    result = {"rows": rows, "steps": grid.steps, "warmup": grid.warmup,
              "seconds": time.perf_counter() - t0}  # fmt: skip
    write_report(args.out, result, md)


if __name__ == "__main__":
    main()
