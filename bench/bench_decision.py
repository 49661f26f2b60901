"""A slot-placement decision's host time: measured, as the simulator charges it, and as a
device build would take.

Legend: R ranks, E experts, K experts per token, B slots per rank, W the window (32
steps), S tokens per rank per step.

``moonplan-auto`` and the runtime's placer use a decision (``Residency.decide_on``) once
the steps whose predicted time covers its counted work have passed
(``moonplan.plan.residency.work``): the builds of the ``resident`` candidate it makes
(``made``, at ``StepCost.decide_s`` each) and the (step, table) pairs it scores without
one (``scored``, at ``StepCost.score_s``). The runtime's calibration times both rates
(``refill.time_rates``); the simulator charges ``moonplan.baselines.decision_time``'s,
fitted to this script's figures. The decision runs on a host thread: numpy for the
tables, torch ops on the CPU for their scores over the window. Per case, on one window:

* ``made`` and ``scored``: the work the decision counted;
* ``host ms``: the median wall time of the decision here (one thread);
* ``build us`` and ``score us``: the two rates ``time_rates`` measures on the window's
  last step (what the runtime's calibration would set);
* ``charged ms``: the work at ``decision_time``'s rates, what the simulator charges (and
  ``host / charged``, how well the fit holds);
* ``device ms``: builds at ``planner_time.resident_us`` (their most rounds: an upper
  bound) and scores at
  ``planner_time.exit_us``, what the work would take as device kernels (an estimate), and
  ``host / device``;
* ``table host ms`` and ``table torch ms``: one table's score over the window (the most
  replicated table), step by step in numpy (``target.window_s``, the reference) and
  every step at once in torch ops (``residency.window_torch``, what a decision runs, and
  the form that also runs on the device; here on this host's CPU), side by side;
  ``bench/gpu_check.py`` times the torch form on a GPU.

The window is synthetic: a fixed lognormal popularity (``sigma``) with every step's
records drawn from it, the persistent routing the placement is built for. The serving
slots are empty, so the decision scores every table.

    OMP_NUM_THREADS=1 python bench/bench_decision.py            # 8 cases (about 1 min)
    python bench/bench_decision.py --quick --out /tmp/x.json
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch
from _common import markdown_table, result_path, timing_parser, write_report

from moonplan.baselines.decision_time import decision_build_us, decision_score_us
from moonplan.baselines.planner_time import exit_us, resident_us
from moonplan.plan.choice.rent import roundings
from moonplan.plan.choice.resident import ROUND_LIMIT
from moonplan.plan.residency.refill import time_decision, time_rates
from moonplan.plan.residency.target import pack, replica_counts, step_time_over, window_s
from moonplan.plan.residency.window import WINDOW
from moonplan.plan.residency.window_torch import window_torch
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.stepcost import StepCost
from moonplan.stepcost.hardware import get_hardware

CASES = (  # model, hardware, R, S, sigma, B
    ("mixtral-8x7b", "h200-node", 8, 256, 1.0, 2),
    ("olmoe-1b-7b", "h200-node", 8, 256, 1.0, 2),
    ("olmoe-1b-7b", "h200-node", 8, 16, 1.0, 8),  # the real decode traces' shape
    ("deepseek-v3", "h200-node", 8, 16, 1.0, 2),
    ("deepseek-v3", "h200-node", 8, 4096, 1.0, 2),
    ("deepseek-v3", "h20-node", 8, 256, 2.0, 2),
    ("deepseek-v3", "h200-multinode", 64, 256, 1.0, 2),
    ("deepseek-v3", "h200-multinode", 64, 4096, 1.0, 2),
)
SLOTS = 2
"""``B`` of ``most_replicated``'s table by default (``_gpu_decision``'s cases)."""


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


def measure(case: tuple[str, str, int, int, float, int], reps: int) -> dict[str, Any]:
    """One decision's counted work, charge and host time at ``case``."""
    model, hw, R, S, sigma, B = case
    m, h = get_model(model), get_hardware(hw)
    cost = SimConfig().step_cost(m, h, "moonplan-auto", R)
    E = m.num_experts
    steps = window(E, R, S, m.top_k, sigma)
    host_s, work = time_decision(cost, steps, B, reps)
    build_s, score_s = time_rates(cost, steps[-1], B, reps)
    table_host_ms, table_torch_ms = time_table(cost, steps, reps, B)
    charged_us = work.made * decision_build_us(R, E) + work.scored * decision_score_us(R, E)
    most = roundings(cost) * ROUND_LIMIT  # rounds of a build, at most
    device_us = work.made * resident_us(R, E, most) + work.scored * exit_us(R, E)
    return {"model": model, "hardware": hw, "ranks": R, "experts": E, "tokens": S,
            "sigma": sigma, "slots": B, "made": work.made, "scored": work.scored,
            "host_ms": host_s * 1e3, "build_us": build_s * 1e6, "score_us": score_s * 1e6,
            "charged_ms": charged_us * 1e-3, "device_ms": device_us * 1e-3,
            "table_host_ms": table_host_ms, "table_torch_ms": table_torch_ms}  # fmt: skip


def most_replicated(
    cost: StepCost, steps: list[torch.Tensor], slots: int = SLOTS
) -> tuple[list[np.ndarray], list[float], np.ndarray]:
    """The window's steps (int64 ``[R, E]`` each, numpy), static EP's seconds of each, and
    the table of ``slots`` replicas a rank (int64 ``[R, slots]``) the placement packs for
    the window's loads: the one whose score ``time_table`` and ``_gpu_decision`` time."""
    R = steps[0].shape[0]
    totals = [int(t) for t in torch.stack(steps)[:, 0].sum(0)]
    empty = [[-1] * slots for _ in range(R)]
    slot_RB = np.array(pack(replica_counts(totals, R, slots * R), totals, slots, empty))
    rows = [c.numpy() for c in steps]
    statics = [step_time_over(cost, c, np.full_like(slot_RB, -1)) for c in rows]
    return rows, statics, slot_RB


def time_table(
    cost: StepCost, steps: list[torch.Tensor], reps: int, slots: int = SLOTS
) -> tuple[float, float]:
    """Median milliseconds of one table's window score, numpy step by step and torch all
    at once (module docstring), alternated; the two must agree float for float."""
    rows, statics, slot_RB = most_replicated(cost, steps, slots)
    args = (torch.stack(steps), torch.tensor(statics, dtype=torch.float64),
            torch.from_numpy(slot_RB))  # fmt: skip
    host, dense = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        want = window_s(cost, rows, statics, slot_RB)
        t1 = time.perf_counter()
        got = sum(window_torch(cost, *args).tolist())
        host.append(t1 - t0)
        dense.append(time.perf_counter() - t1)
        assert got == want, (got, want)
    return statistics.median(host) * 1e3, statistics.median(dense) * 1e3


def fit_line(x_N: np.ndarray, y_N: np.ndarray) -> tuple[float, float]:
    """``(base, slope)``, both positive, of the line ``base + slope * x`` whose logarithm
    is nearest ``log(y)`` in least squares over the ``N`` points (each rate off its line
    by a factor, not by microseconds: the cases span 50x). A grid of ``Q`` candidates of
    each over both logarithms, refined five times around its best point."""
    log_base, log_slope = np.log(y_N.mean()), np.log(y_N.mean() / max(x_N.mean(), 1.0))
    span = 8.0
    for _ in range(5):
        base_Q = np.exp(np.linspace(log_base - span, log_base + span, 81))
        slope_Q = np.exp(np.linspace(log_slope - span, log_slope + span, 81))
        line_QQN = base_Q[:, None, None] + slope_Q[None, :, None] * x_N[None, None, :]
        err_QQ = ((np.log(line_QQN) - np.log(y_N)) ** 2).sum(-1)
        i, j = np.unravel_index(int(err_QQ.argmin()), err_QQ.shape)
        log_base, log_slope, span = float(np.log(base_Q[i])), float(np.log(slope_Q[j])), span / 8
    return float(np.exp(log_base)), float(np.exp(log_slope))


def refit(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the lines in ``R * E`` that this run's measured rates give
    (:func:`fit_line`), beside those the simulator charges
    (``moonplan.baselines.decision_time``), and each case's rate over its refit line."""
    x_N = np.array([r["ranks"] * r["experts"] for r in rows], dtype=np.float64)
    out = []
    for key, charged in (("build_us", decision_build_us), ("score_us", decision_score_us)):
        y_N = np.array([r[key] for r in rows], dtype=np.float64)
        base, slope = fit_line(x_N, y_N)
        off = y_N / (base + slope * x_N)
        now = charged(0, 0), charged(1, 1) - charged(0, 0)
        out.append(f"* `{key}`: refit {base:.1f} + {slope:.4f} * R * E (each case "
                   f"{off.min():.2f}-{off.max():.2f}x its line); charged now "
                   f"{now[0]:.1f} + {now[1]:.4f} * R * E")  # fmt: skip
    return out


def main() -> None:
    ap = timing_parser(__doc__, reps=3, out=result_path("bench_decision.json"))
    args = ap.parse_args()
    cases = CASES[:2] if args.quick else CASES
    rows = [measure(c, args.reps) for c in cases]
    header = ["model", "hw", "R", "S", "sigma", "B", "made", "scored", "host ms",
              "build us", "score us", "charged ms", "host / charged", "device ms",
              "host / device", "table host ms", "table torch ms", "host / torch"]  # fmt: skip
    lines = [[r["model"], r["hardware"], str(r["ranks"]), str(r["tokens"]), str(r["sigma"]),
              str(r["slots"]), str(r["made"]), str(r["scored"]), f"{r['host_ms']:.1f}",
              f"{r['build_us']:.0f}", f"{r['score_us']:.0f}", f"{r['charged_ms']:.1f}",
              f"{r['host_ms'] / r['charged_ms']:.2f}", f"{r['device_ms']:.2f}",
              f"{r['host_ms'] / r['device_ms']:.0f}x", f"{r['table_host_ms']:.1f}",
              f"{r['table_torch_ms']:.1f}", f"{r['table_host_ms'] / r['table_torch_ms']:.2f}"]
             for r in rows]  # fmt: skip
    md = ["# A slot-placement decision's host time", "", markdown_table(header, lines), "",
          *refit(rows)]  # fmt: skip
    write_report(args.out, {"rows": rows, "reps": args.reps}, md)


if __name__ == "__main__":
    main()
