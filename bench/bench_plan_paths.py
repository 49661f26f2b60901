"""What one planner call costs per policy, where the runtime makes it.

Legend: R ranks (EP), S tokens per rank; DeepSeek-V3 (E=256, top-8), sigma 1, the second
step of a drifting trace with the first step's auto plan as ``previous``.

Per case it times (median of ``--reps``, wall clock, synchronised on CUDA)
``moonplan.plan(counts, previous=..., policy=<policy>)`` on the counts' device: ``static``
(``balance="off"``), ``exact`` (the fused CUDA kernel where available), named candidates,
and ``auto`` twice: ``auto full`` with the early exit made impossible (every candidate
built and scored) and ``auto exit`` with it certain (the test alone): the two paths of the
one call ``balance="auto"`` makes each step.

Run it on a CUDA machine for the GPU figures (``docs/benchmarks.md``); on a CPU-only
machine every path runs on the CPU. Prints a table, writes JSON (``--out``)::

    python bench/bench_plan_paths.py [--reps 15] [--out bench/results/plan_paths.json]

``--count`` counts instead of timing: per policy and ``check_input``, the host reads
(synchronisations on a GPU) and the kernels (aten ops less views) of one call, with
``tests/plan/host_work.py``; the same call makes the same ops on a GPU, except that
``exact`` runs the fused kernel there (one launch, no host read) and the torch
builder's host scan here, and ``auto`` the fused choice kernel there (three launches, no
host read; its torch form ``moonplan.plan.choice.tensor`` where the kernel is unavailable)
and its host form here. Writes ``bench/results/plan_paths_count.json`` by default.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import bench_parser, median_us  # noqa: E402  (bench/ is the script's folder)

from moonplan.plan.api import plan  # noqa: E402
from moonplan.simulate.model_time import SimConfig  # noqa: E402
from moonplan.simulate.models import get_model  # noqa: E402
from moonplan.simulate.workload import drifting_counts  # noqa: E402
from moonplan.stepcost.hardware import get_hardware  # noqa: E402
from tests.plan.host_work import host_work  # noqa: E402

CASES = [(8, 16), (8, 4096), (64, 64), (64, 4096)]
NAMED = ("static", "exact", "resident", "level-4", "greedy")
COUNTED = ("static", "exact")
FORCED_S = 1e9  # a planning charge no step beats: forces one path of auto


def _inputs(R: int, S: int, device: torch.device) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """``(cost, prev, c0, c1)``: the cost model, step 1's auto plan on ``device`` and the
    two steps' host counts."""
    m = get_model("deepseek-v3")
    cost = SimConfig().step_cost(m, get_hardware("h200-node"), "moonplan-auto")
    c0, c1 = drifting_counts(R, m.num_experts, S, m.top_k, sigma=1.0, steps=2, seed=0)
    return cost, plan(c0.to(device), policy="auto", cost=cost), c0, c1


def count_row(R: int, S: int, device: torch.device) -> dict[str, Any]:
    """Host reads and kernels of one named call per path at ``(R, S)`` (``--count``)."""
    _, prev, _, c1 = _inputs(R, S, device)
    counts = c1.to(device)
    row: dict[str, Any] = {"ranks": R, "tokens": S, "device": str(device)}
    for name in COUNTED:
        for check in (True, False):
            w = host_work(
                lambda n=name, c=check: plan(counts, previous=prev, policy=n, check_input=c)
            )
            row[f"{name} check={check}"] = {"reads": w.host_reads, "kernels": w.kernels}
    return row


def case_row(R: int, S: int, device: torch.device, reps: int) -> dict[str, Any]:
    """Times of every path at ``(R, S)`` on ``device`` (module docstring)."""
    cost, prev, _, c1 = _inputs(R, S, device)
    counts = c1.to(device)
    cuda = device.type == "cuda"
    row: dict[str, Any] = {"ranks": R, "tokens": S, "device": str(device)}
    for name in NAMED:
        row[f"named {name}"] = median_us(
            lambda n=name: plan(counts, previous=prev, policy=n, cost=cost), reps, cuda
        )
    for path, forced in (
        ("full", cost.scaled(exit_s=FORCED_S)),
        ("exit", cost.scaled(plan_s=FORCED_S)),
    ):
        row[f"auto {path}"] = median_us(
            lambda f=forced: plan(counts, previous=prev, policy="auto", cost=f), reps, cuda
        )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None, help="JSON output (default bench/results/...)")
    ap.add_argument("--count", action="store_true", help="count host reads and kernels")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.count:
        return _count(device, args.out or str(ROOT / "bench/results/plan_paths_count.json"))
    args.out = args.out or str(ROOT / "bench/results/plan_paths.json")
    rows = [case_row(R, S, device, args.reps) for R, S in CASES]
    cols = [f"named {n}" for n in NAMED] + ["auto full", "auto exit"]
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}; microseconds, median of {args.reps}")  # fmt: skip
    print(f"{'EP':>4} {'S':>6} " + " ".join(f"{c:>17}" for c in cols))
    for r in rows:
        print(f"{r['ranks']:>4} {r['tokens']:>6} " + " ".join(f"{r[c]:>17.0f}" for c in cols))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


def _count(device: torch.device, out: str) -> int:
    """``--count``: print and write the host reads / kernels table."""
    rows = [count_row(R, S, device) for R, S in CASES]
    cols = [f"{n} check={c}" for n in COUNTED for c in (True, False)]
    print(f"device: {device}; host reads / kernels of one call")
    print(f"{'EP':>4} {'S':>6} " + " ".join(f"{c:>20}" for c in cols))
    for r in rows:
        cells = [f"{r[c]['reads']} / {r[c]['kernels']}" for c in cols]
        print(f"{r['ranks']:>4} {r['tokens']:>6} " + " ".join(f"{x:>20}" for x in cells))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
