"""Experts benchmark: ``grouped_swiglu`` (``torch._grouped_mm``) vs the per-group loop.

For each ``(T, H, F, G)`` and dtype it times, interleaved in the same run, the
forward (and with ``--backward`` forward + backward) of
:func:`moonplan.runtime.experts.grouped_swiglu` and of the readable per-group loop
:func:`moonplan.runtime.experts.swiglu_reference`, on rows split into ``G`` groups
of lognormal-skewed sizes (some empty) plus a few padding rows. Prints a table
with the median times and their ratio (loop / grouped: > 1 means grouped is faster;
also the ratio of the fastest runs, steadier on a busy machine) and writes JSON (``--out``).

    python bench/bench_experts.py              # T=4096, H=1024, F=512, G=8..64, fp32 + bf16
    python bench/bench_experts.py --quick      # small sizes (CI smoke)

Legend: T rows, H hidden, F expert FFN size, G groups.
"""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Callable
from typing import Any

import torch
from _common import TextTable, median_ms, result_path, time_interleaved, timing_parser, write_json

from moonplan.runtime.experts import grouped_swiglu, swiglu_reference

CONFIGS = [(4096, 1024, 512, G) for G in (8, 16, 32, 64)]
QUICK = [(256, 64, 32, 4), (512, 128, 64, 16)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PAD_ROWS = 5


def inputs(T: int, H: int, F: int, G: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    """Rows, ``[G+1]`` offsets (lognormal sizes, ~10% empty, ``PAD_ROWS`` trailing) and weights."""
    gen = torch.Generator().manual_seed(seed)
    w_G = torch.exp(torch.randn(G, generator=gen))
    w_G[torch.rand(G, generator=gen) < 0.1] = 0
    sizes_G = torch.floor(w_G / w_G.sum() * (T - PAD_ROWS)).long()
    sizes_G[int(torch.argmax(w_G))] += T - PAD_ROWS - int(sizes_G.sum())
    offsets_G1 = torch.cat([torch.zeros(1, dtype=torch.long), sizes_G.cumsum(0)])
    x_TH = torch.randn(T, H, generator=gen).to(dtype)
    gate_up = (torch.randn(G, 2 * F, H, generator=gen) / H**0.5).to(dtype)
    down = (torch.randn(G, H, F, generator=gen) / F**0.5).to(dtype)
    return x_TH, offsets_G1, gate_up, down


def step(fn: Callable, args: tuple, backward: bool) -> None:
    if not backward:
        with torch.no_grad():
            fn(*args)
        return
    x, offsets, gate_up, down = args
    leaves = [t.detach().requires_grad_() for t in (x, gate_up, down)]
    y = fn(leaves[0], offsets, leaves[1], leaves[2])
    y.backward(torch.ones_like(y))


def time_pair(args: tuple, reps: int, backward: bool) -> dict[str, float]:
    """Median seconds of grouped and loop, alternating one call each (after one warm-up)."""
    grouped_s, loop_s = time_interleaved(
        lambda: step(grouped_swiglu, args, backward),
        lambda: step(swiglu_reference, args, backward),
        reps,
        warmup=1,
    )
    out = median_ms({"grouped": grouped_s, "loop": loop_s})
    out["loop_over_grouped"] = out["loop_ms"] / out["grouped_ms"]
    out["loop_over_grouped_min"] = min(loop_s) / min(grouped_s)
    return out


def check(args: tuple) -> float:
    """Max relative difference of grouped vs loop (sanity; fp32 <= 1e-5)."""
    a, b = grouped_swiglu(*args).double(), swiglu_reference(*args).double()
    return float((a - b).abs().max() / b.abs().max())


def run(configs: list[tuple[int, int, int, int]], reps: int, backward: bool) -> list[dict]:
    rows = []
    for T, H, F, G in configs:
        for name, dtype in DTYPES.items():
            args = inputs(T, H, F, G, dtype)
            row: dict[str, Any] = {"T": T, "H": H, "F": F, "G": G, "dtype": name}
            row["empty_groups"] = int((args[1][1:] == args[1][:-1]).sum())
            row["rel_diff"] = check(args)
            row.update(time_pair(args, reps, backward))
            rows.append(row)
            print(TABLE.row(row), flush=True)
    return rows


TABLE = TextTable(
    "{T:>5} {H:>5} {F:>5} {G:>3} {dtype:>5} {empty_groups:>5} {rel_diff:>9.1e} {grouped_ms:>10.2f} "
    "{loop_ms:>9.2f} {loop_over_grouped:>12.2f} {loop_over_grouped_min:>6.2f}",
    "T|H|F|G|dtype|empty|rel diff|grouped ms|loop ms|loop/grouped|(min)",
)


def main() -> None:
    ap = timing_parser(__doc__, reps=5, out=result_path("bench_experts.json"))
    ap.add_argument("--backward", action="store_true", help="time forward + backward")
    args = ap.parse_args()
    machine = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "date": datetime.date.today().isoformat(),
        "load_avg_1min": round(os.getloadavg()[0], 1),  # a busy machine makes ratios noisy
        "pass": "forward+backward" if args.backward else "forward",
    }
    print(", ".join(f"{k} {v}" for k, v in machine.items()))
    print(TABLE.header())
    rows = run(QUICK if args.quick else CONFIGS, args.reps, args.backward)
    write_json(args.out, {**machine, "rows": rows})


if __name__ == "__main__":
    main()
