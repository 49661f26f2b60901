"""Two-stage all-to-all (``a2a-hosts``) against the per-record all-to-all (``a2a``):
rows and bytes that cross hosts at top-8, 4 gloo ranks as 2 hosts of 2.

Every rank draws its tokens' ids (``bench_route.draw_ids``), the counts make one exact
plan, and both transports run dispatch + combine + combine-backward +
dispatch-backward on the same rows, in turn, in the same processes. Counts are per
step, summed over the ranks:

* ``records``: (token, k) records; ``a2a x-host``: the records whose executing rank
  sits on another host (the per-record transport sends one row per record);
* ``once/rank``: distinct (token, rank) pairs on other hosts (token-once per
  destination rank, for reference: counted from the routes, no transport run);
* ``2-stage x-host``: rows the two-stage transport sent to other hosts in dispatch
  (``last_traffic``: one per (token, other host)), checked against the distinct
  (token, host) pairs of the routes; ``ratio``: 2-stage / a2a;
* ``fwd MiB``: bytes crossing hosts in dispatch + combine, rows and their
  metadata (a2a: an int64 offset per row in dispatch, per asked row in combine;
  2-stage: 16 bytes per record in dispatch); ``intra``: rows the two-stage transport
  forwarded inside hosts in dispatch (its extra pass; a2a has none);
* ``ms``: median wall time of one step of each (rank 0, barrier-aligned). Not
  meaningful here: the "hosts" share one CPU and gloo's loopback, so the network
  these rows save costs nothing; it shows the extra local work only.

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
from _common import bench_parser, write_json
from bench_route import draw_ids

from moonplan.testing.dist import run_ranks

R, L, E, K = 4, 2, 64, 8  # ranks, ranks per host, experts, top-k
SCENARIOS = ["uniform", "group-limited", "lognormal-2"]


def _step(t: Any, plan: Any, route: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One step's four operations (row-wise stand-in experts); the output."""
    view = t.dispatch(x, route, plan, weight_SK=w)
    recv = view.tensor.clone()
    y = t.combine(recv.tanh(), route, w, view.state)
    t.combine_backward(y, route, plan, w, view.state)
    t.dispatch_backward(recv, route, view.state)
    return y


def _route_counts(route: Any, me: int) -> dict[str, int]:
    """This rank's records, and pairs crossing hosts, from its route alone."""
    dest_SK = route.dest_rank
    tok_SK = torch.arange(dest_SK.shape[0])[:, None].expand_as(dest_SK)
    away_SK = dest_SK // L != me // L
    pairs_rank = {(int(s), int(d)) for s, d in zip(tok_SK[away_SK], dest_SK[away_SK], strict=True)}
    pairs_host = {(s, d // L) for s, d in pairs_rank}
    return {"records": dest_SK.numel(), "a2a_x": int(away_SK.sum()),
            "once_rank_x": len(pairs_rank), "pairs_host_x": len(pairs_host)}  # fmt: skip


def _rank(rank: int, world: int, scenario: str, S: int, H: int, reps: int) -> dict[str, Any]:
    import moonplan
    from moonplan.comm.group import EPGroup
    from moonplan.runtime.transports import registry

    os.environ["LOCAL_WORLD_SIZE"] = str(L)  # this rank process only
    torch.set_num_threads(1)
    seed = zlib.crc32(f"{scenario} {S} {H}".encode())
    ids = draw_ids(scenario, world, E, S, K, seed)
    plan = moonplan.plan(torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids]))
    route = moonplan.route(plan, rank, ids[rank])
    gen = torch.Generator().manual_seed(seed + rank)
    x, w = torch.randn(S, H, generator=gen).bfloat16(), torch.rand(S, K, generator=gen)
    group = EPGroup()
    cap = int(plan.recv_size().max())
    ts = {n: registry.create(n, group, capacity=cap, hidden=H, dtype=torch.bfloat16)
          for n in ("a2a", "a2a-hosts")}  # fmt: skip
    times: dict[str, list[float]] = {n: [] for n in ts}
    ys = {}
    for _ in range(reps):
        for name, t in ts.items():
            group.barrier()
            t0 = time.perf_counter()
            ys[name] = _step(t, plan, route, x, w)
            group.barrier()
            times[name].append(time.perf_counter() - t0)
    traffic = ts["a2a-hosts"].last_traffic  # type: ignore[attr-defined]
    d, c = traffic["dispatch"], traffic["combine"]
    return {
        **_route_counts(route, rank),
        "hosts_x": d.inter_rows, "hosts_x_bytes": d.inter_bytes + c.inter_bytes,
        "intra": d.intra_rows,
        "ms": {n: 1e3 * statistics.median(v) for n, v in times.items()},
        "max_diff": float((ys["a2a"].float() - ys["a2a-hosts"].float()).abs().max()),
    }  # fmt: skip


def one(scenario: str, S: int, H: int, reps: int) -> dict[str, Any]:
    got = run_ranks(_rank, R, scenario, S, H, reps, timeout=600)
    total = {k: sum(g[k] for g in got) for k in ("records", "a2a_x", "once_rank_x",
                                                  "pairs_host_x", "hosts_x", "intra")}  # fmt: skip
    if total["hosts_x"] != total["pairs_host_x"]:
        sent, pairs = total["hosts_x"], total["pairs_host_x"]
        raise AssertionError(f"{sent} rows crossed hosts; the routes have {pairs} (token, host)")
    row = H * 2  # bf16
    a2a_bytes = 2 * total["a2a_x"] * (row + 8)  # dispatch rows + offsets, combine asks + rows
    return {
        "scenario": scenario, "R": R, "ranks_per_host": L, "E": E, "K": K, "S": S, "H": H,
        **total, "ratio": total["hosts_x"] / max(total["a2a_x"], 1),
        "a2a_x_mib": a2a_bytes / 2**20,
        "hosts_x_mib": sum(g["hosts_x_bytes"] for g in got) / 2**20,
        "ms_a2a": got[0]["ms"]["a2a"], "ms_hosts": got[0]["ms"]["a2a-hosts"],
        "max_abs_diff_bf16": max(g["max_diff"] for g in got),
    }  # fmt: skip


# the table's columns: (header, key of one()'s result, format)
COLUMNS = [
    ("scenario", "scenario", "<14"), ("records", "records", ">8"),
    ("a2a x-host", "a2a_x", ">11"), ("once/rank", "once_rank_x", ">10"),
    ("2-stage x-host", "hosts_x", ">15"), ("ratio", "ratio", ">7.2f"),
    ("fwd MiB a2a", "a2a_x_mib", ">12.2f"), ("2-stage", "hosts_x_mib", ">8.2f"),
    ("intra", "intra", ">7"), ("ms a2a", "ms_a2a", ">8.1f"), ("2-stage", "ms_hosts", ">8.1f"),
]  # fmt: skip


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank (default 512)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per transport (default 5)")
    ap.add_argument("--out", default="bench/results/two_stage.json", help="JSON output path")
    args = ap.parse_args()
    S, H, reps = (64, 64, 2) if args.quick else (args.tokens, args.hidden, args.reps)
    print(f"R={R} as {R // L} hosts of {L}, E={E}, top-{K}, S={S} tokens/rank, H={H}, bf16; "
          "rows summed over ranks, one step; ms not meaningful (one CPU, loopback)")  # fmt: skip
    print("".join(f"{head:{fmt.split('.')[0]}}" for head, _, fmt in COLUMNS))
    results = []
    for scenario in SCENARIOS:
        results.append(one(scenario, S, H, reps))
        print("".join(f"{results[-1][key]:{fmt}}" for _, key, fmt in COLUMNS), flush=True)
    write_json(args.out, {"rows": results})


if __name__ == "__main__":
    main()
