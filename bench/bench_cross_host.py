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

Four more measure what a change could buy (experiments too, none in the code):

* ``aligned cuts``: the allocation changed, the routing not. Where an expert's holders sit
  on different hosts, each cut between two of them is moved (as little as it can) into the
  range where both keep every record of their own host's sources (the interval rule gives
  a holder a slice of the source order, and a host's sources are one interval of it);
* ``proportional``: host-first, each host's kept records taken from every one of its
  sources and executors in proportion (rank-order ``domain-first`` takes the first ranks'
  first), the rest across hosts also in proportion: a closed form, rounded up per rank;
* ``proxy``: the plan's routing, but a record bound for another host goes over the slow
  link to that host's rank with its source's local index, which forwards it over the fast
  links (the two stages of ``transport="a2a-hosts"``, a row per record here: that
  transport also sends a token once per host, so it sends at most these rows);
* ``least (LP)``: the least busiest slow-link rows of any routing and allocation with the
  same holders (the experts each rank runs in the plan) and no rank above the plan's
  largest rows: a linear program (HiGHS through ``scipy``, an optional dependency of this
  script alone; the column reads ``-`` without it). A lower bound, not a rule.

Columns: rows crossing hosts in all (summed over ranks), the busiest rank's slow-link rows
(the most sent or received by one rank) and the dispatch time the step-cost formula gives
each (``StepCost``'s all-to-all: latency plus the busiest link). Means over the steps.

    OMP_NUM_THREADS=1 python bench/bench_cross_host.py           # 3 points (about 3 min)
    python bench/bench_cross_host.py --steps 4 --out /tmp/x.json  # shorter
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import numpy as np
from _common import bench_parser, markdown_table, result_path, write_report

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


def aligned_cuts(sent_RE: np.ndarray, alloc_ER: np.ndarray, G: int) -> np.ndarray:
    """``alloc_ER`` with each cut between two holders on different hosts moved, as little as
    it can, into the range where both keep their own host's sources' records under the
    interval rule (module docstring); the cuts stay in order and each expert's total."""
    E = sent_RE.shape[1]
    out = alloc_ER.copy()
    for e in range(E):
        hs = np.nonzero(alloc_ER[e])[0]  # the holders with rows, by rank
        if len(set((hs // G).tolist())) < 2:
            continue
        before = np.concatenate([[0], np.cumsum(sent_RE[:, e])])  # records of sources < s
        cut = np.cumsum(alloc_ER[e, hs])
        for i in range(len(hs) - 1):
            lo, hi = before[(hs[i] // G + 1) * G], before[hs[i + 1] // G * G]
            if hs[i] // G != hs[i + 1] // G and lo <= hi:
                cut[i] = min(max(cut[i], lo), hi)
        out[e, hs] = np.diff(np.maximum.accumulate(cut), prepend=0)
    return out


def proportional(sent_RE: np.ndarray, alloc_ER: np.ndarray, G: int) -> Traffic:
    """Rows per rank by link when each host keeps ``m = min(sources, executors)`` of each
    expert's records, taken from all its sources and executors in proportion, and the rest
    crosses hosts in proportion too (module docstring); each rank's rows rounded up."""
    R, E = sent_RE.shape
    src_EH = sent_RE.T.reshape(E, R // G, G).sum(2).astype(np.float64)
    dst_EH = alloc_ER.reshape(E, R // G, G).sum(2).astype(np.float64)
    kept_EH = np.minimum(src_EH, dst_EH)
    src_keep = np.divide(kept_EH, src_EH, out=np.ones_like(kept_EH), where=src_EH > 0)
    dst_keep = np.divide(kept_EH, dst_EH, out=np.ones_like(kept_EH), where=dst_EH > 0)
    host_R = np.arange(R) // G
    # a kept record of source s lands on s itself in the share s runs of its host's rows
    run_share_RE = np.divide(alloc_ER.T, dst_EH[:, host_R].T, out=np.zeros((R, E)),
                             where=dst_EH[:, host_R].T > 0)  # fmt: skip
    kept_RE = sent_RE * src_keep[:, host_R].T
    local_R = (kept_RE * run_share_RE).sum(1)
    kept_in_R = (alloc_ER.T * dst_keep[:, host_R].T).sum(1)

    def up(x: np.ndarray) -> np.ndarray:
        return np.ceil(x - 1e-9).astype(np.int64)

    return Traffic(up(local_R), up(kept_RE.sum(1) - local_R), up(sent_RE.sum(1) - kept_RE.sum(1)),
                   up(kept_in_R - local_R), up(alloc_ER.sum(0) - kept_in_R))  # fmt: skip


def proxy(sent_RE: np.ndarray, alloc_ER: np.ndarray, G: int) -> Traffic:
    """Rows per rank by link when the interval rule's records for another host go first to
    that host's rank with the source's local index (module docstring, ``proxy``)."""
    R, E = sent_RE.shape
    local_R, send_2R, recv_2R = (np.zeros(shape, dtype=np.int64) for shape in (R, (2, R), (2, R)))
    for e in range(E):
        for s, r, n in interval_pairs(sent_RE[:, e].tolist(), alloc_ER[e].tolist()):
            hop = r if s // G == r // G else r // G * G + s % G  # the proxy across hosts
            for a, b, link in ((s, hop, int(hop // G != s // G)), (hop, r, 0)):
                if a == b:
                    continue
                send_2R[link, a] += n
                recv_2R[link, b] += n
            local_R[r] += n if s == r else 0
    return Traffic(local_R, send_2R[0], send_2R[1], recv_2R[0], recv_2R[1])


def least_busiest(sent_RE: np.ndarray, alloc_ER: np.ndarray, G: int) -> float | None:
    """The least busiest slow-link rows (sent or received by one rank) of any routing and
    allocation with ``alloc_ER``'s holders and no rank above its largest rows: a linear
    program (module docstring); ``None`` without ``scipy``."""
    try:
        from scipy.optimize import linprog
        from scipy.sparse import coo_matrix
    except ImportError:
        return None
    R = sent_RE.shape[0]
    e_V, s_V, r_V = (a.ravel() for a in np.nonzero((sent_RE.T[:, :, None] > 0)
                                                   & (alloc_ER[:, None, :] > 0)))  # fmt: skip
    V, across_V = len(e_V), (s_V // G) != (r_V // G)
    # rows 0..R-1: rows run by r; R..2R-1: received across by r; 2R..3R-1: sent across by s
    row = np.concatenate([r_V, R + r_V[across_V], 2 * R + s_V[across_V], np.arange(R, 3 * R)])
    col = np.concatenate([np.arange(V), np.flatnonzero(across_V), np.flatnonzero(across_V),
                          np.full(2 * R, V)])  # fmt: skip
    val = np.concatenate([np.ones(V + 2 * across_V.sum()), -np.ones(2 * R)])
    ub = np.concatenate([np.full(R, alloc_ER.sum(0).max()), np.zeros(2 * R)])
    pair_V = e_V * R + s_V  # one equality per (expert, source): all its records routed
    keys, eq_V = np.unique(pair_V, return_inverse=True)
    a_eq = coo_matrix((np.ones(V), (eq_V, np.arange(V))), shape=(len(keys), V + 1))
    b_eq = sent_RE.T.ravel()[keys].astype(np.float64)
    a_ub = coo_matrix((val, (row, col)), shape=(3 * R, V + 1))
    c = np.zeros(V + 1)
    c[V] = 1.0  # minimise the busiest slow-link rows
    got = linprog(c, A_ub=a_ub, b_ub=ub, A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
    if not got.success:
        raise RuntimeError(f"the LP failed: {got.message}")
    return float(got.fun)


VARIANTS = ("interval", "domain_first", "aligned_cuts", "proportional", "proxy", "least_lp")
"""The rows of each point: the plan as it is, then the experiments (module docstring)."""


def step_row(cost: StepCost, sent_RE: np.ndarray, alloc_ER: np.ndarray, G: int) -> list[float]:
    """``[inter rows, busiest inter, dispatch us]`` for each of :data:`VARIANTS`, the dispatch
    by the step-cost formula (``StepCost.step_time`` given each one's rows). The LP gives only
    its busiest rows (NaN without ``scipy``): its total is NaN and its dispatch the least any
    rank's slow-link rows allow, latency plus the busiest rows at the slow link's rate."""
    E, R = alloc_ER.shape
    home_E, none_ER = np.asarray(home_list(E, R)), np.zeros((E, R), dtype=bool)
    aligned = aligned_cuts(sent_RE, alloc_ER, G)
    out = []
    for alloc, t in ((alloc_ER, dispatch_traffic(sent_RE, alloc_ER, G)),
                     (alloc_ER, domain_first(sent_RE, alloc_ER, G)),
                     (aligned, dispatch_traffic(sent_RE, aligned, G)),
                     (alloc_ER, proportional(sent_RE, alloc_ER, G)),
                     (alloc_ER, proxy(sent_RE, alloc_ER, G))):  # fmt: skip
        busiest = int(np.maximum(t.send_inter_R, t.recv_inter_R).max())
        at = cost.step_time(alloc, sent_RE, none_ER, home_E, planned=0, traffic=t)
        out += [float(t.send_inter_R.sum()), float(busiest), at.dispatch_s * 1e6]
    least = least_busiest(sent_RE, alloc_ER, G)
    lat = cost.base_latency_s + cost.per_peer_latency_s * (R - 1)
    if least is None:
        return out + [float("nan")] * 3
    return [*out, float("nan"), least, (lat + least * cost.dispatch_row_s_inter) * 1e6]


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
    n = 3 * len(VARIANTS)
    mean = [statistics.fmean(c) for c in zip(*rows, strict=True)] if rows else [math.nan] * n
    keys = ("inter_rows", "busiest_inter", "dispatch_us")
    out: dict[str, Any] = {"model": name, "hardware": hw_name, "ranks": R, "sigma": sigma,
                           "tokens": S, "resident_steps": len(rows)}  # fmt: skip
    for i, v in enumerate(VARIANTS):
        out[v] = dict(zip(keys, mean[3 * i : 3 * i + 3], strict=True))
    return out


def report(results: list[dict[str, Any]]) -> list[str]:
    """The markdown table of :func:`run_point`'s results: a row per point and variant."""
    head = ["model", "EP", "sigma", "S", "steps", "variant", "x-host rows",
            "busiest x-host rank", "dispatch us"]  # fmt: skip
    lines = []
    for r in results:
        for v in VARIANTS:
            a = r[v]
            lines.append([r["model"], str(r["ranks"]), f"{r['sigma']:g}", str(r["tokens"]),
                          str(r["resident_steps"]), v.replace("_", " "),
                          _fmt(a["inter_rows"], 0), _fmt(a["busiest_inter"], 0),
                          _fmt(a["dispatch_us"], 1)])  # fmt: skip
    return [markdown_table(head, lines), "", "(means over the steps; `-`: not measured)"]


def _fmt(x: float, digits: int) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--steps", type=int, default=32, help="measured steps per point (32)")
    p.add_argument("--out", default=result_path("cross_host.json"), help="JSON path")
    args = p.parse_args()
    start = time.perf_counter()
    results = [run_point(point, args.steps) for point in POINTS]
    seconds = time.perf_counter() - start
    write_report(args.out, {"points": results, "seconds": seconds}, report(results))


if __name__ == "__main__":
    main()
