"""GPU section of a slot-placement decision's scoring for ``bench/gpu_check.py``.

Legend: R ranks, E experts, W window steps (32), B slots per rank (2), S tokens per rank.

A decision scores ``B + 2`` slot tables over the window's ``W`` steps
(``moonplan.plan.residency.target.target_slots``) with
``moonplan.plan.residency.window_torch``: one table over every step at once in torch ops.
On this project's CPU a decision takes 0.06-1.7 s (``docs/benchmarks.md``). This
section times that form on the device (synchronised, median of ``reps``) for the most
replicated table of ``bench_decision``'s windows, and checks each step's float against
the host form (``target.window_s``'s terms). ``--cpu-smoke`` runs it on the CPU on one small case.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from bench_decision import most_replicated, window

from moonplan.plan.residency.target import served_s
from moonplan.plan.residency.window_torch import window_torch
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.stepcost.hardware import get_hardware

CASES = (  # model, hardware, R, S, sigma: bench_decision's, one per model and scale
    ("olmoe-1b-7b", "h200-node", 8, 256, 1.0),
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
    """One case's timing and check (module docstring)."""
    model, hw, R, S, sigma = case
    m = get_model(model)
    cost = SimConfig().step_cost(m, get_hardware(hw), "moonplan-auto", R)
    E = m.num_experts
    steps = window(E, R, S, m.top_k, sigma)
    rows_np, statics, slot_RB = most_replicated(cost, steps)
    rows_SRE = torch.stack(steps)
    want = [served_s(cost, c, slot_RB, s) for c, s in zip(rows_np, statics, strict=True)]
    args = (rows_SRE.to(dev), torch.tensor(statics, dtype=torch.float64, device=dev),
            torch.from_numpy(slot_RB).to(dev))  # fmt: skip
    got = window_torch(cost, *args).tolist()  # also the warm-up
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        window_torch(cost, *args)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    table_ms = sorted(times)[len(times) // 2] * 1e3
    return {"model": model, "hardware": hw, "ranks": R, "tokens": S, "steps": len(want),
            "table_ms": table_ms, "matches_host": got == want}  # fmt: skip
