"""GPU section of a slot-placement decision's scoring for ``bench/gpu_check.py``.

Legend: R ranks, E experts, W window steps (32), B slots per rank (2), S tokens per rank.

A decision scores up to ``B + 2`` slot tables over the window's ``W`` steps
(``moonplan.plan.residency.target.target_of``) with
``moonplan.plan.residency.window_torch``: every table over every step at once in torch
ops. On this project's CPU a decision takes 0.03-1.3 s (``docs/benchmarks.md``). This
section times that form on the device (synchronised, median of ``reps``) on
``bench_decision``'s windows: the most replicated table alone (``table_ms``) and the
decision's tables from empty slots in one call (``tables_ms``, ``tables`` of them), and
checks each step's float against the host form (``target.served_s``). It also times a
whole decision with the window on the device (``refill.time_decision``: the tables on
the host, their scores on the device; ``decision_ms``) beside the same decision on the
host (``decision_host_ms``), and the two rates the runtime's calibration would set there
(``refill.time_rates``: ``build_us``, ``score_us``), at ``B = 2`` and, for the real
decode traces' shape (OLMoE, EP 8, 16 tokens), ``B = 8``.
``--cpu-smoke`` runs it on the CPU on one small case.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from bench_decision import most_replicated, window

from moonplan.plan.residency.refill import time_decision, time_rates
from moonplan.plan.residency.target import candidate_tables, served_s
from moonplan.plan.residency.window_torch import window_torch, windows_torch
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.stepcost.hardware import get_hardware

CASES = (  # model, hardware, R, S, sigma: bench_decision's, one per model and scale
    ("olmoe-1b-7b", "h200-node", 8, 256, 1.0),
    ("olmoe-1b-7b", "h200-node", 8, 16, 1.0),
    ("deepseek-v3", "h200-node", 8, 16, 1.0),
    ("deepseek-v3", "h200-multinode", 64, 256, 1.0),
)


def decision_section(smoke: bool = False) -> dict[str, Any]:
    """Per case: milliseconds of one table's window score on the device, and whether every
    step's seconds equal the host form's."""
    dev = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    cases = [("mixtral-8x7b", "h200-node", 4, 16, 1.0)] if smoke else list(CASES)
    rows = [_row(case, dev, 2 if smoke else 10) for case in cases]
    if not all(r["matches_host"] for r in rows):
        raise AssertionError(f"the torch window score differs from the host's: {rows}")
    return {"device": str(dev), "rows": rows}


def _row(case: tuple[str, str, int, int, float], dev: torch.device, reps: int) -> dict[str, Any]:
    """One case's timings and checks (module docstring)."""
    model, hw, R, S, sigma = case
    m = get_model(model)
    cost = SimConfig().step_cost(m, get_hardware(hw), "moonplan-auto", R)
    E = m.num_experts
    steps = window(E, R, S, m.top_k, sigma)
    rows_np, statics, slot_RB = most_replicated(cost, steps)
    rows_SRE = torch.stack(steps)
    static_S = torch.tensor(statics, dtype=torch.float64)
    empty_RB = torch.full((R, slot_RB.shape[1]), -1, dtype=torch.int64)
    loads_SE = rows_SRE.sum(1)
    slot_TRB, _ = candidate_tables(loads_SE.sum(0), len(steps), empty_RB, cost, loads_SE)
    want = [[served_s(cost, c, t_RB, s) for c, s in zip(rows_np, statics, strict=True)]
            for t_RB in [slot_RB, *slot_TRB.numpy()]]  # fmt: skip
    on = (rows_SRE.to(dev), static_S.to(dev))
    one = (*on, torch.from_numpy(slot_RB).to(dev))
    table_ms, got = _timed(lambda: window_torch(cost, *one), dev, reps)
    tables_ms, got_T = _timed(lambda: windows_torch(cost, *on, slot_TRB.to(dev)), dev, reps)
    match = [got.tolist(), *got_T.tolist()] == want
    B = 8 if (model, S) == ("olmoe-1b-7b", 16) else slot_RB.shape[1]
    on_dev = [c.to(dev) for c in steps]
    decision_s, work = time_decision(cost, on_dev, B, reps)
    host_s, _ = time_decision(cost, steps, B, min(reps, 3))
    build_s, score_s = time_rates(cost, on_dev[-1], B, min(reps, 3))
    return {"model": model, "hardware": hw, "ranks": R, "tokens": S, "steps": len(steps),
            "table_ms": table_ms, "tables": len(slot_TRB), "tables_ms": tables_ms,
            "matches_host": match, "slots": B, "made": work.made, "scored": work.scored,
            "decision_ms": decision_s * 1e3, "decision_host_ms": host_s * 1e3,
            "build_us": build_s * 1e6, "score_us": score_s * 1e6}  # fmt: skip


def _timed(call: Callable[[], torch.Tensor], dev: torch.device, reps: int) -> tuple[float, Any]:
    """Median milliseconds of ``call`` (synchronised on CUDA) over ``reps`` runs after a
    warm-up, and the warm-up's result."""
    out = call()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3, out
