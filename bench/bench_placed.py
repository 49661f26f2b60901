"""On the real traces, what whole experts moved into the slots would buy: static EP over a
placement, against auto and the peers.

Legend: R ranks (8), E experts (64), B slots per rank (``default_slots``: 2), W the window
(the 32 steps before the measured ones); ``server[e]``: the one rank that runs expert
``e``'s records (its home, or a rank holding it in a slot).

At decode and prefill sizes on one host, auto lost to EPLB and to round-robin static EP by
3-9% on the recorded traces before it had the ``placed`` candidate (static EP over whole
experts moved into the slots, ``moonplan.plan.choice.table``) and the whole-move table of
the slot placement (``residency.target.whole_moves``). This script measured that lever
before it was built, and now compares auto's own (the ``auto`` column) with a slower
placement that scores every move with the full step cost:

* ``placed``: each step, static EP over ``server``: all of an expert's records to one rank.
  ``server`` is chosen once from the window's mean step (``residency.target.mean_step``):
  starting from the homes, move one expert into a free slot of another rank at a time, the
  move that lowers the predicted step time (``StepCost.step_time``, auto's cost) most, until
  none does. Its planning is charged like static EP's at the exit (``StepCost.exit_s``): a
  table lookup, no search;
* ``+ copies``: the same with the placement's copies charged, each expert's weights over a
  fast link one after the other (``copy_s_intra``), spread over as many steps as the
  deployed EPLB keeps a placement on the same trace (``recorded_options``' period). The
  refill would copy beside the steps instead, so this charge is the larger of the two.

``skip build`` counts the measured steps where ``placed`` is within the exit's least
``resident`` build (one round a rounding, ``rent.exit_build_s`` less the test) of the
least time of any plan that copies nothing over
the same holders (:func:`nocopy_bound`). There an early exit could serve ``placed`` without
building the ``resident`` candidate, which is what keeps auto from holding replicas at
decode sizes today.

The other columns come from the simulator in the same run (``run_recorded``: the
deployed EPLB with its moves charged, ``moonplan-auto`` as the sweep runs it). Training
traces are left out: a training step changes every weight, so no slot stays resident.

    OMP_NUM_THREADS=1 python bench/bench_placed.py                 # 16 points (about 3 min)
    python bench/bench_placed.py --traces decode-l1 --out /tmp/x.json
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch
from _common import bench_parser, markdown_table, result_path, write_report

from moonplan.plan.choice.bound import experts_lb_s, link_time, links_host, totals_host
from moonplan.plan.choice.rent import exit_build_s
from moonplan.plan.home import home_list
from moonplan.plan.residency.target import mean_step
from moonplan.plan.residency.window import WINDOW
from moonplan.runtime.slot_budget import default_slots
from moonplan.simulate.acceptance import RECORDED_STEPS, recorded_options, run_recorded
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.stepcost import StepCost
from moonplan.stepcost.hardware import get_hardware
from moonplan.traces.real import real_trace

MODEL = "olmoe-1b-7b"
TRACES = tuple(f"{kind}-l{i}" for kind in ("decode", "prefill") for i in range(4))
HARDWARE = ("h200-node", "h20-node")
PEERS = ("static-linear", "static-round-robin", "eplb", "moonplan-auto")


def static_over(cost: StepCost, counts_RE: np.ndarray, server_E: np.ndarray) -> float:
    """Predicted seconds of static EP over ``server_E`` (nothing fetched, no planning)."""
    R, E = counts_RE.shape
    alloc_ER = np.zeros((E, R), dtype=np.int64)
    alloc_ER[np.arange(E), server_E] = counts_RE.sum(0)
    home_E, none_ER = np.asarray(home_list(E, R)), np.zeros((E, R), dtype=bool)
    return cost.step_time(alloc_ER, counts_RE, none_ER, home_E, planned=0).total_s


def place(cost: StepCost, mean_RE: np.ndarray, slots: int) -> np.ndarray:
    """int64 ``[E]`` ``server``: greedy whole-expert moves into free slots (module docstring)."""
    R, E = mean_RE.shape
    home_E = np.asarray(home_list(E, R), dtype=np.int64)
    server_E, free_R = home_E.copy(), np.full(R, slots)
    now = static_over(cost, mean_RE, server_E)
    while True:
        best = (now, -1, -1)
        for e in np.flatnonzero(mean_RE.sum(0)):
            for g in np.flatnonzero(free_R):
                if g in (server_E[e], home_E[e]):
                    continue
                trial = server_E.copy()
                trial[e] = g
                best = min(best, (static_over(cost, mean_RE, trial), int(e), int(g)))
        if best[1] < 0:
            return server_E
        now, e, g = best
        server_E[e] = g
        free_R[g] -= 1


def nocopy_bound(cost: StepCost, counts_RE: np.ndarray, server_E: np.ndarray) -> float:
    """Seconds no plan that copies nothing can beat, its planning not charged: every rank
    sends at least its records of the experts it does not hold (home or ``server``), some
    of them over the slow link (``bound.links_host``'s ``sends[s][0]`` and ``far``), and
    the experts phase is at least ``bound.experts_lb_s``."""
    R, E = counts_RE.shape
    home_E = np.asarray(home_list(E, R), dtype=np.int64)
    moved_E = server_E != home_E
    resident_ER = np.zeros((E, R), dtype=bool)
    resident_ER[np.flatnonzero(moved_E), server_E[moved_E]] = True
    totals = totals_host(cost, counts_RE.sum(0))
    sends, far, _ = links_host(counts_RE, resident_ER, home_E, cost.domain_size(R))
    rows = link_time(cost, R)
    d = max(rows(row[0], far[s])[0] for s, row in enumerate(sends))
    c = max(rows(row[0], far[s])[1] for s, row in enumerate(sends))
    lat = cost.base_latency_s + cost.per_peer_latency_s * (R - 1)
    return lat + d + experts_lb_s(cost, R, *totals) + lat + c


def placed_point(name: str, hw_name: str) -> dict[str, Any]:
    """``placed`` and ``+ copies`` (µs, means over the measured steps) on one trace."""
    counts_TRE = real_trace(name).numpy()
    T, R, E = counts_TRE.shape
    cost = SimConfig().step_cost(get_model(MODEL), get_hardware(hw_name), "moonplan-auto", R)
    first = T - RECORDED_STEPS
    window_E = torch.from_numpy(counts_TRE[first - WINDOW : first].sum((0, 1)))
    server_E = place(cost, mean_step(window_E, WINDOW, R), default_slots(E, R))
    steps = [static_over(cost, counts_TRE[t], server_E) for t in range(first, T)]
    placed = (statistics.fmean(steps) + cost.exit_s) * 1e6
    build = exit_build_s(cost) - cost.exit_s
    skip = sum(s <= nocopy_bound(cost, counts_TRE[t], server_E) + build
               for s, t in zip(steps, range(first, T), strict=True))  # fmt: skip
    moved = int((server_E != np.asarray(home_list(E, R))).sum())
    copies = cost.base_latency_s + moved * cost.copy_s_intra if moved else 0.0
    period = recorded_options(T, RECORDED_STEPS)["eplb_period"]
    return {"placed_us": placed, "with_copies_us": placed + copies / period * 1e6,
            "moved": moved, "period": period, "skip_build": skip}  # fmt: skip


def run(traces: tuple[str, ...], hardware: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per trace and hardware: the peers' and auto's µs, then ``placed``'s."""
    recorded = {name: real_trace(name) for name in traces}
    rows = run_recorded(recorded, MODEL, hardware, SimConfig(), policies=PEERS)
    out = []
    for r in rows:
        got = placed_point(r["trace"], r["hardware"])
        peers = {p: r["us"][p] for p in PEERS if p != "moonplan-auto"}
        best = min(peers.values())
        out.append({"trace": r["trace"], "hardware": r["hardware"], "us": r["us"], **got,
                    "best_peer_us": best, "auto_vs_best": r["us"]["moonplan-auto"] / best,
                    "placed_vs_best": got["with_copies_us"] / best})  # fmt: skip
    return out


def report(results: list[dict[str, Any]]) -> list[str]:
    """The markdown table of :func:`run`'s rows."""
    head = ["trace", "hardware", "static", "round-robin", "EPLB", "auto", "placed",
            "+ copies", "moved", "skip build", "auto / best", "placed / best"]  # fmt: skip
    lines = [[r["trace"], r["hardware"], *(f"{r['us'][p]:.1f}" for p in PEERS),
              f"{r['placed_us']:.1f}", f"{r['with_copies_us']:.1f}", str(r["moved"]),
              f"{r['skip_build']}/{RECORDED_STEPS}", f"{r['auto_vs_best']:.3f}",
              f"{r['placed_vs_best']:.3f}"]
             for r in results]  # fmt: skip
    return [markdown_table(head, lines), "", "(µs a step, means over the measured steps)"]


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--traces", nargs="+", default=list(TRACES), help="recorded traces")
    p.add_argument("--hardware", nargs="+", default=list(HARDWARE), help="hardware presets")
    p.add_argument("--out", default=result_path("placed.json"), help="JSON path")
    args = p.parse_args()
    start = time.perf_counter()
    results = run(tuple(args.traces), tuple(args.hardware))
    seconds = time.perf_counter() - start
    write_report(args.out, {"rows": results, "seconds": seconds}, report(results))


if __name__ == "__main__":
    main()
