"""Across hosts, what sets the dispatch of auto's ``resident`` plans: routing or balance.

Legend: R ranks (EP size), G ranks per host (fast-link domain), E experts, S tokens per
rank; rows are (token, k) records sent as one ``H``-vector each (``dispatch="record"``).

At the worst cross-host points of ``bench_auto_sweep.py`` auto serves every step with the
``resident`` candidate (a diffusion that balances each rank's records over the resident
replicas, ``moonplan.plan.choice.resident``). Its dispatch and combine are the larger part
of the step. This script runs ``moonplan-auto`` over the same trace as the sweep and, for
each measured step it served with ``resident``, compares two routings of the same
allocation ``x[e, r]``:

* ``interval``: what the plan does (``moonplan.stepcost.traffic.dispatch_traffic``): each
  expert's sources and executors laid out in rank order, a record going from the source
  whose interval holds it to the executor whose interval holds it;
* ``domain-first``: an experiment, not in the code: each host first matches its own
  sources of an expert to its own executors of it (the same interval rule inside the
  host, as many records as both sides have), and only the rest crosses hosts (the
  interval rule over the leftovers, in rank order).

Columns: rows crossing hosts in all (summed over ranks), the busiest rank's slow-link rows
(the most sent or received by one rank) and the dispatch time the step-cost formula gives
each (``StepCost``'s all-to-all: latency plus the busiest link). Means over the steps.

    OMP_NUM_THREADS=1 python bench/bench_cross_host.py           # 3 points (about 2 min)
    python bench/bench_cross_host.py --steps 4 --out /tmp/x.json  # shorter
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import bench_parser, markdown_table, write_report

from moonplan.baselines.prehistory import step_ranges
from moonplan.baselines.registry import make_policy
from moonplan.plan.home import home_list
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.simulate.sweep import policy_options
from moonplan.simulate.workload import drifting_counts, prehistory
from moonplan.stepcost import StepCost, Traffic, dispatch_traffic
from moonplan.stepcost.hardware import get_hardware
from moonplan.traces.persistence import PERSISTENT_SHARE

POINTS = (  # (model, hardware, EP, sigma, tokens per rank): the sweep's worst across hosts
    ("deepseek-v3", "h200-multinode", 64, 2.0, 64),
    ("deepseek-v3", "h200-multinode", 64, 1.0, 64),
    ("kimi-k3-like", "h200-multinode", 64, 2.0, 64),
)
RESULTS = Path(__file__).resolve().parent / "results"
WARMUP, RHO, SEED, SLOTS = 8, 0.99, 0, 2  # the sweep's (``AcceptanceGrid``'s defaults)


def interval_pairs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(i, j, n)``: ``n`` records from source ``i`` to executor ``j`` when both sides'
    counts are laid out in order and matched position by position."""
    out, i, j = [], 0, 0
    src, dst = list(src), list(dst)
    while i < len(src) and j < len(dst):
        n = min(src[i], dst[j])
        if n > 0:
            out.append((i, j, n))
        src[i], dst[j] = src[i] - n, dst[j] - n
        i, j = i + (src[i] == 0), j + (dst[j] == 0)
    return out


def _take(left_G: np.ndarray, m: int) -> np.ndarray:
    """The first ``m`` records of ``left_G`` (int64 ``[G]``), rank by rank."""
    return np.diff(np.minimum(np.cumsum(left_G), m), prepend=0)


def domain_first(sent_RE: np.ndarray, alloc_ER: np.ndarray, G: int) -> Traffic:
    """The rows per rank, by link, under the ``domain-first`` routing (module docstring):
    ``dispatch_traffic``'s :class:`Traffic` for this rule."""
    R, E = sent_RE.shape
    local_R, send_2R, recv_2R = (np.zeros(shape, dtype=np.int64) for shape in (R, (2, R), (2, R)))

    def route(pairs: list[tuple[int, int, int]], offset: int, link: int) -> None:
        for i, j, n in pairs:  # link 0: inside a host, 1: across hosts
            i, j = i + offset, j + offset
            if i == j:
                local_R[i] += n
            else:
                send_2R[link, i] += n
                recv_2R[link, j] += n

    for e in range(E):
        src, dst = sent_RE[:, e].copy(), alloc_ER[e].copy()
        for d0 in range(0, R, G):
            h = slice(d0, d0 + G)
            m = min(int(src[h].sum()), int(dst[h].sum()))
            s_G, d_G = _take(src[h], m), _take(dst[h], m)
            route(interval_pairs(s_G.tolist(), d_G.tolist()), d0, 0)
            src[h], dst[h] = src[h] - s_G, dst[h] - d_G
        route(interval_pairs(src.tolist(), dst.tolist()), 0, 1)  # the rest: across hosts
    return Traffic(local_R, send_2R[0], send_2R[1], recv_2R[0], recv_2R[1])


def step_row(cost: StepCost, sent_RE: np.ndarray, alloc_ER: np.ndarray, G: int) -> list[float]:
    """``[inter rows, busiest inter, dispatch us]`` for interval, then for domain-first; the
    dispatch by the step-cost formula (``StepCost.step_time`` given each routing's rows)."""
    E, R = alloc_ER.shape
    home_E, none_ER = np.asarray(home_list(E, R)), np.zeros((E, R), dtype=bool)
    out = []
    for t in (dispatch_traffic(sent_RE, alloc_ER, G), domain_first(sent_RE, alloc_ER, G)):
        busiest = int(np.maximum(t.send_inter_R, t.recv_inter_R).max())
        at = cost.step_time(alloc_ER, sent_RE, none_ER, home_E, planned=0, traffic=t)
        out += [float(t.send_inter_R.sum()), float(busiest), at.dispatch_s * 1e6]
    return out


def run_point(point: tuple[str, str, int, float, int], steps: int) -> dict[str, Any]:
    """Auto over the point's trace; the means of :func:`step_row` over its ``resident`` steps."""
    name, hw_name, R, sigma, S = point
    model, hw = get_model(name), get_hardware(hw_name)
    E, K = model.num_experts, model.top_k
    law = {"sigma": sigma, "rho": RHO, "seed": SEED, "persistent": PERSISTENT_SHARE}
    counts = drifting_counts(R, E, S, K, steps=WARMUP + steps, **law)
    cost = SimConfig().step_cost(model, hw, "moonplan-auto", R)
    opts = policy_options(hw, R, slots=SLOTS)
    auto = make_policy("moonplan-auto", R, E, **opts, cost=cost, layers=model.num_moe_layers)
    auto.prime(prehistory(step_ranges(auto.steps_before()), ranks=R, experts=E, tokens=S,
                          topk=K, **law))  # fmt: skip
    G, rows = cost.domain_size(R), []
    for t in range(WARMUP + steps):
        got = auto.step(counts[t])
        if t >= WARMUP and got.choice == "resident":
            rows.append(step_row(cost, got.sent_RE.numpy(), got.alloc_ER.numpy(), G))
    mean = [statistics.fmean(c) for c in zip(*rows, strict=True)] if rows else [float("nan")] * 6
    keys = ("inter_rows", "busiest_inter", "dispatch_us")
    return {"model": name, "hardware": hw_name, "ranks": R, "sigma": sigma, "tokens": S,
            "resident_steps": len(rows), "interval": dict(zip(keys, mean[:3], strict=True)),
            "domain_first": dict(zip(keys, mean[3:], strict=True))}  # fmt: skip


def report(results: list[dict[str, Any]]) -> list[str]:
    """The markdown table of :func:`run_point`'s results."""
    head = ["model", "EP", "sigma", "S", "steps", "x-host rows", "busiest x-host rank",
            "dispatch us"]  # fmt: skip
    lines = []
    for r in results:
        a, b = r["interval"], r["domain_first"]
        lines.append([r["model"], str(r["ranks"]), f"{r['sigma']:g}", str(r["tokens"]),
                      str(r["resident_steps"]),
                      f"{a['inter_rows']:.0f} -> {b['inter_rows']:.0f}",
                      f"{a['busiest_inter']:.0f} -> {b['busiest_inter']:.0f}",
                      f"{a['dispatch_us']:.1f} -> {b['dispatch_us']:.1f}"])  # fmt: skip
    return [markdown_table(head, lines), "", "(interval -> domain-first; means over the steps)"]


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--steps", type=int, default=32, help="measured steps per point (32)")
    p.add_argument("--out", default=str(RESULTS / "cross_host.json"), help="JSON path")
    args = p.parse_args()
    start = time.perf_counter()
    results = [run_point(point, args.steps) for point in POINTS]
    seconds = time.perf_counter() - start
    write_report(args.out, {"points": results, "seconds": seconds}, report(results))


if __name__ == "__main__":
    main()
