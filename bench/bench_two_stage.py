"""Rows and bytes that cross hosts: per-record rows (``a2a-records``), token rows
(``a2a``) and two-stage token rows (``a2a-hosts``), top-8, 4 gloo ranks as 2 hosts
of 2, measured from the transports in one run.

Every rank draws its tokens' ids (``bench_route.draw_ids``), the counts make one exact
plan, every rank routes with affinity (as the layer does for token rows) and the three
transports run dispatch + combine + combine-backward + dispatch-backward on the same
rows, in turn, in the same processes. Counts are per step, summed over the ranks:

* ``records``: (token, k) records;
* ``x-host rows`` of dispatch: ``records`` the records whose executing rank sits on
  another host (one row each); ``tokens`` the distinct (token, rank) pairs on other hosts
  (one row each); ``2-stage`` the transport's ``StepState.traffic["rows_inter"]``, which
  must equal the distinct (token, other host) pairs counted from the routes (the script
  fails otherwise); ``ratio``: 2-stage / records;
* ``x-host MiB`` of dispatch + combine (each transport's ``StepState.traffic``
  definition: rows, and for token rows 8 bytes per record, for two-stage also 24 bytes
  per forwarding entry; the all-to-all's int64 offset per row is not counted): records
  and tokens counted from the routes, 2-stage the transport's ``bytes_inter``;
* ``intra``: rows the two-stage transport forwarded to other ranks of their host
  (``rows_intra``, its extra pass);
* ``ms``: median wall time of one step of each (rank 0, barrier-aligned). Not meaningful
  here: the "hosts" share one CPU and gloo's loopback, so the network these rows save
  costs nothing; it shows the extra local work only.

    python bench/bench_two_stage.py            # the table, JSON to bench/results/two_stage.json
    python bench/bench_two_stage.py --quick    # small sizes (smoke test)
"""

from __future__ import annotations

import os
import statistics
import time
import zlib
from typing import Any

import torch
from _common import result_path, timing_parser, write_json
from bench_route import draw_ids

from moonplan.testing.dist import run_ranks

R, G, E, K = 4, 2, 64, 8  # ranks, ranks per host, experts, top-k
SCENARIOS = ["uniform", "group-limited", "lognormal-2"]
NAMES = ("a2a-records", "a2a", "a2a-hosts")  # per record, token rows, two-stage


def _step(t: Any, plan: Any, route: Any, x: torch.Tensor, w: torch.Tensor) -> tuple[Any, dict]:
    """One step's four operations (row-wise stand-in experts): the output, the traffic."""
    view = t.dispatch(x, route, plan, weight_SK=w)
    recv = view.tensor.clone()
    y = t.combine(recv.tanh(), route, w, view.state)
    t.combine_backward(y, route, plan, w, view.state)
    t.dispatch_backward(recv, route, view.state)
    return y, view.state.traffic


def _route_counts(route: Any, me: int) -> dict[str, int]:
    """This rank's records and the pairs crossing hosts, from its route alone (Python sets)."""
    dest = route.dest_rank.tolist()
    away = [(s, d) for s, row in enumerate(dest) for d in row if d // G != me // G]
    return {
        "records": sum(len(row) for row in dest),
        "records_x": len(away),
        "tokens_x": len(set(away)),
        "pairs_host_x": len({(s, d // G) for s, d in away}),
    }


def _rank(rank: int, world: int, scenario: str, S: int, H: int, reps: int) -> dict[str, Any]:
    import moonplan
    from moonplan.comm.group import EPGroup
    from moonplan.runtime.transports import registry

    os.environ["LOCAL_WORLD_SIZE"] = str(G)  # this rank process only
    torch.set_num_threads(1)
    seed = zlib.crc32(f"{scenario} {S} {H}".encode())
    ids = draw_ids(scenario, world, E, S, K, seed)
    plan = moonplan.plan(torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids]))
    route = moonplan.route(plan, rank, ids[rank], affinity=True)
    gen = torch.Generator().manual_seed(seed + rank)
    x, w = torch.randn(S, H, generator=gen).bfloat16(), torch.rand(S, K, generator=gen)
    group = EPGroup()
    cap = int(plan.recv_size().max())
    ts = {n: registry.create(n, group, capacity=cap, hidden=H, dtype=torch.bfloat16) for n in NAMES}
    times: dict[str, list[float]] = {n: [] for n in ts}
    ys, traffic = {}, {}
    for _ in range(reps):
        for name, t in ts.items():
            group.barrier()
            t0 = time.perf_counter()
            ys[name], traffic[name] = _step(t, plan, route, x, w)
            group.barrier()
            times[name].append(time.perf_counter() - t0)
    hosts = traffic["a2a-hosts"]
    diff = (ys["a2a-records"].float() - ys["a2a-hosts"].float()).abs()
    return {
        **_route_counts(route, rank),
        "hosts_x": hosts["rows_inter"],
        "hosts_x_bytes": hosts["bytes_inter"],
        "intra": hosts["rows_intra"],
        "ms": {n: 1e3 * statistics.median(v) for n, v in times.items()},
        "max_diff": float(diff.max()) if diff.numel() else 0.0,
    }


def one(scenario: str, S: int, H: int, reps: int) -> dict[str, Any]:
    """One scenario on ``R`` ranks: the summed counts, MiB and times (one table row)."""
    got = run_ranks(_rank, R, scenario, S, H, reps, timeout=600)
    keys = ("records", "records_x", "tokens_x", "pairs_host_x", "hosts_x", "intra")
    total = {k: sum(g[k] for g in got) for k in keys}
    if total["hosts_x"] != total["pairs_host_x"]:
        sent, pairs = total["hosts_x"], total["pairs_host_x"]
        raise AssertionError(f"{sent} rows crossed hosts; the routes have {pairs} (token, host)")
    row = H * 2  # bf16
    mib = 2.0**20
    return {
        "scenario": scenario,
        "R": R,
        "ranks_per_host": G,
        "E": E,
        "K": K,
        "S": S,
        "H": H,
        **total,
        "ratio": total["hosts_x"] / max(total["records_x"], 1),
        "records_x_mib": 2 * total["records_x"] * row / mib,  # dispatch rows, combine rows
        "tokens_x_mib": (2 * total["tokens_x"] * row + 8 * total["records_x"]) / mib,
        "hosts_x_mib": sum(g["hosts_x_bytes"] for g in got) / mib,
        **{f"ms_{n}": got[0]["ms"][n] for n in NAMES},
        "max_abs_diff_bf16": max(g["max_diff"] for g in got),
    }


# the table: a header and a row template over one()'s result (numbers right-aligned)
HEADER = (
    "scenario       records  x-host rows: records  tokens 2-stage ratio"
    "  MiB: records  tokens 2-stage  intra  ms: records tokens 2-stage"
)
ROW = (
    "{scenario:<14}{records:>8}{records_x:>22}{tokens_x:>8}{hosts_x:>8}{ratio:>6.2f}"
    "{records_x_mib:>15.2f}{tokens_x_mib:>8.2f}{hosts_x_mib:>8.2f}{intra:>7}"
    "{ms_a2a_records:>13.0f}{ms_a2a:>7.0f}{ms_a2a_hosts:>8.0f}"
)


def _table_keys(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with names :data:`ROW` can use (``-`` in a field name is not allowed)."""
    return {k.replace("-", "_"): v for k, v in result.items()}


def main() -> None:
    ap = timing_parser(__doc__, reps=3, out=result_path("two_stage.json"))
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank (default 512)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    args = ap.parse_args()
    S, H, reps = (64, 64, 1) if args.quick else (args.tokens, args.hidden, args.reps)
    print(f"R={R} as {R // G} hosts of {G}, E={E}, top-{K}, S={S} tokens/rank, H={H}, bf16; "
          "summed over ranks, one step; ms not meaningful (one CPU, loopback)")  # fmt: skip
    print(HEADER)
    results = []
    for scenario in SCENARIOS:
        results.append(one(scenario, S, H, reps))
        print(ROW.format_map(_table_keys(results[-1])), flush=True)
    write_json(args.out, {"torch": torch.__version__, "rows": results})


if __name__ == "__main__":
    main()
