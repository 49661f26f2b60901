"""The weighted lookup's weights for a decision's slot tables: the reference table by table
against the batched torch form, side by side.

Legend: E experts, R ranks, B slots per rank, T slot tables, N experts replicated in some
table (each pouring pass runs over them).

A decision scores ``T`` slot tables; the weighted lookup needs each table's weights
(``moonplan.plan.residency.shares``): ``shares_reference`` (Python floats, one table at
a time, looped over the ``T`` tables) and ``table_shares`` (torch ops, every table at
once, here on this host's CPU). Both give the same weights (checked). Per case, on one
window's mean step (a fixed lognormal popularity, ``sigma`` 1, DeepSeek-V3's top-8 at
``S`` tokens per rank, 32 steps):

* ``packed`` tables: the ``B + 1`` replica tables and the whole moves a decision scores
  (``target.candidate_tables``), then replica tables packed for drifting windows up to
  ``T``: tables that share most of their replicated experts;
* ``random`` tables: every slot a random expert away from its home (the worst case for
  the batched form: nearly every expert is replicated in some table, and its loop runs
  over them all).

Columns: ``ref ms`` and ``fast ms`` the median wall times (alternated, after a warm-up),
their ratio, and each per table.

    OMP_NUM_THREADS=1 python bench/bench_shares.py            # 10 cases (about 1 min)
    python bench/bench_shares.py --quick --out /tmp/x.json
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from _common import markdown_table, result_path, time_interleaved, timing_parser, write_report

from moonplan.plan.residency.shares import shares_reference, table_shares
from moonplan.plan.residency.target import candidate_tables, pack, replica_counts
from moonplan.plan.torch_backend import resident_map
from moonplan.stepcost import StepCost
from moonplan.testing.tables import random_slot_tables

CASES = (  # E, R, B, T, tables
    (256, 64, 2, 8, "packed"),
    (256, 64, 2, 32, "packed"),
    (256, 64, 2, 8, "random"),
    (256, 64, 2, 32, "random"),
    (64, 8, 2, 8, "packed"),
    (64, 8, 2, 32, "packed"),
    (64, 8, 2, 8, "random"),
    (64, 8, 2, 32, "random"),
    (256, 8, 2, 8, "packed"),
    (256, 8, 2, 8, "random"),
)
STEPS, TOKENS, TOP_K = 32, 4096, 8
"""The window: steps, tokens per rank per step, experts per token."""


def window(E: int, R: int, seed: int = 0) -> tuple[torch.Tensor, torch.Generator]:
    """int64 ``[E]``: the window's records per expert (a lognormal popularity), and the
    generator, to draw the tables with."""
    g = torch.Generator().manual_seed(seed)
    pop_E = torch.exp(torch.randn(E, generator=g, dtype=torch.float64))
    return (pop_E / pop_E.sum() * STEPS * TOKENS * TOP_K * R).round().long(), g


def packed_tables(
    cost: StepCost, totals_E: torch.Tensor, R: int, B: int, T: int, g: torch.Generator
) -> torch.Tensor:
    """int64 ``[T, R, B]``: a decision's candidate tables from empty slots, then tables
    packed for drifting windows (the popularity times a lognormal factor of sigma 0.3)
    with 1 to ``B`` replicas a rank, in turn."""
    empty = torch.full((R, B), -1, dtype=torch.int64)
    tables = list(candidate_tables(totals_E, STEPS, empty, cost)[0])
    while len(tables) < T:
        drift_E = torch.exp(0.3 * torch.randn(len(totals_E), generator=g, dtype=torch.float64))
        totals = (totals_E * drift_E).round().long().tolist()
        n_E = replica_counts(totals, R, (1 + len(tables) % B) * R)
        tables.append(torch.tensor(pack(n_E, totals, B, empty.tolist()), dtype=torch.int64))
    return torch.stack(tables[:T])


def measure(case: tuple[int, int, int, int, str], reps: int) -> dict[str, Any]:
    """One case's medians, reference against batched, alternated; the weights checked
    equal."""
    E, R, B, T, kind = case
    cost = StepCost.from_hardware("h200-node" if R <= 8 else "h200-multinode", "deepseek-v3")
    totals_E, g = window(E, R)
    mean_E = totals_E.double() / STEPS
    if kind == "packed":
        slot_TRB = packed_tables(cost, totals_E, R, B, T, g)
    else:
        slot_TRB = random_slot_tables(E, R, B, T, g)

    def reference() -> torch.Tensor:
        return torch.stack([shares_reference(cost, mean_E, resident_map(s, E)) for s in slot_TRB])

    def fast() -> torch.Tensor:
        return table_shares(cost, mean_E, slot_TRB)

    assert torch.equal(reference(), fast()), case
    ref_s, fast_s = time_interleaved(reference, fast, reps, warmup=1)
    held_TE = torch.stack([resident_map(s, E).any(1) for s in slot_TRB])
    ref_ms, fast_ms = statistics.median(ref_s) * 1e3, statistics.median(fast_s) * 1e3
    return {"experts": E, "ranks": R, "slots": B, "tables": T, "kind": kind,
            "poured": int(held_TE.any(0).sum()), "ref_ms": ref_ms, "fast_ms": fast_ms}  # fmt: skip


def main() -> None:
    ap = timing_parser(__doc__, reps=5, out=result_path("bench_shares.json"))
    args = ap.parse_args()
    cases = [c for c in CASES if c[0] == 64 and c[3] == 8] if args.quick else CASES
    t0 = time.perf_counter()
    rows = [measure(c, args.reps) for c in cases]
    header = ["E", "R", "B", "T", "tables", "N", "ref ms", "fast ms", "ref / fast",
              "ref ms / table", "fast ms / table"]  # fmt: skip
    lines = [[str(r["experts"]), str(r["ranks"]), str(r["slots"]), str(r["tables"]), r["kind"],
              str(r["poured"]), f"{r['ref_ms']:.1f}", f"{r['fast_ms']:.1f}",
              f"{r['ref_ms'] / r['fast_ms']:.2f}", f"{r['ref_ms'] / r['tables']:.2f}",
              f"{r['fast_ms'] / r['tables']:.2f}"] for r in rows]  # fmt: skip
    md = ["# The weighted lookup's weights: reference against batched", "",
          markdown_table(header, lines)]  # fmt: skip
    seconds = time.perf_counter() - t0
    write_report(args.out, {"rows": rows, "reps": args.reps, "seconds": seconds}, md)


if __name__ == "__main__":
    main()
