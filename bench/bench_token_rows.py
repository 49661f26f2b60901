"""Token-once dispatch and combine against per-record rows, on CPU: the rows each
version moves between ranks, and the time of its row operations.

One step of an exact plan (``moonplan.plan``) over ``R`` ranks, simulated in one
process (every rank's buffers are plain tensors; on the shm heap they are peers'
memory, so a row written or read there is a row moved between ranks):

* ``per-record``: the source writes each record's token row into its executing
  rank's expert-grouped buffer (``rows.scatter_rows``), and reads the record's output
  back and sums ``w * o`` over ``k`` (a gather, then ``weighted_sum``).
* ``token-once``: the source writes each unique (token, destination) row
  into the destination's token buffer (``rows.scatter_rows`` of the unique rows); the
  destination builds its expert-grouped rows (``expand_rows``) and sums each token's
  weighted outputs into one row (``reduce_rows``); the source reads one row per
  (token, destination) (``rows.gather_rows``) and sums over destinations
  (``reduce_rows``).

``rows moved`` is the number of rows crossing between buffers (records vs unique
rows, own rank included); ``local ms`` is the extra local work of token-once
(``expand`` + both ``reduce``); ``step ms`` all row operations of the step, median of
``--reps`` runs, the two versions alternately in one run; ``ratio`` token-once /
per-record. ``break-even GB/s``: bytes token-once saves (rows, less the int64 token
row and fp32 weight it sends per record) divided by its local time:
over a link slower than that, token-once wins even with its local work serial
(torch reference ops, one CPU thread; the Triton kernels on a GPU are faster).

    python bench/bench_token_rows.py            # the table, JSON to bench/results/token_rows.json
    python bench/bench_token_rows.py --quick    # smaller (CI smoke)
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch
from _common import bench_parser, result_path, write_json
from bench_route import draw_ids, paired_ms

import moonplan
from moonplan.runtime.row_ops import token_torch as ops
from moonplan.runtime.row_ops import torch as rows
from moonplan.runtime.transports.records import weighted_sum

SCENARIOS = ["uniform", "lognormal-2"]
CONFIGS = [(8, 64, 1024, 8, 1024), (8, 256, 1024, 8, 1024)]  # (R, E, S, K, H), top-8
QUICK = [(4, 32, 256, 8, 256)]


def _gather_combine(views, dest_SK, off_SK, w_SK, dtype):  # type: ignore[no-untyped-def]
    """Per-record combine: every record's output row, then ``sum_k w * o`` in fp32."""
    S, K = dest_SK.shape
    o_NH = torch.empty(S * K, views[0].shape[1], dtype=views[0].dtype)
    rows.gather_rows(views, dest_SK.reshape(-1), off_SK.reshape(-1), o_NH)
    return weighted_sum(o_NH.view(S, K, -1), w_SK, dtype)


def _layout(plan: Any, ids: list[torch.Tensor]) -> dict[str, Any]:
    """Every rank's route, and each destination's per-grouped-row token row and weight
    slot (``route_rows``' contract: ``-1`` on padding)."""
    R = plan.num_ranks
    routes = [moonplan.route(plan, s, ids[s], affinity=True) for s in range(R)]  # as the layer
    src_row = [torch.full((int(c),), -1, dtype=torch.int64) for c in plan.recv_size()]
    for route in routes:
        token_row_SK = route.token_row()
        for d in range(R):
            at_SK = route.dest_rank == d
            src_row[d][route.dest_offset[at_SK]] = token_row_SK[at_SK]
    segs = [ops.segments(src_row[d], int(plan.target[d])) for d in range(R)]
    return {"routes": routes, "src_row": src_row, "segs": segs}


def one(scenario: str, R: int, E: int, S: int, K: int, H: int, reps: int) -> dict[str, Any]:
    seed = zlib.crc32(f"{scenario} {R} {E} {S} {K}".encode())
    ids = draw_ids(scenario, R, E, S, K, seed)
    plan = moonplan.plan(torch.stack([torch.bincount(x.reshape(-1), minlength=E) for x in ids]))
    lay = _layout(plan, ids)
    gen = torch.Generator().manual_seed(seed)
    x = [torch.randn(S, H, generator=gen).bfloat16() for _ in range(R)]
    w = [torch.rand(S, K, generator=gen) for _ in range(R)]
    recv = [torch.zeros(int(c), H, dtype=torch.bfloat16) for c in plan.recv_size()]
    tok = [torch.zeros(int(t), H, dtype=torch.bfloat16) for t in plan.target]
    # each grouped row's weight at its destination (the source sends it with the token row)
    w_at = [torch.zeros(int(c)) for c in plan.recv_size()]
    for s, route in enumerate(lay["routes"]):
        for d in range(R):
            at_SK = route.dest_rank == d
            w_at[d][route.dest_offset[at_SK]] = w[s][at_SK]
    local_s = [0.0]

    def per_record() -> None:
        for s, rt in enumerate(lay["routes"]):
            rows.scatter_rows(x[s], rt.dest_rank.reshape(-1), rt.dest_offset.reshape(-1), K, recv)
        for s, rt in enumerate(lay["routes"]):
            _gather_combine(recv, rt.dest_rank, rt.dest_offset, w[s], torch.bfloat16)

    def token_once() -> None:
        for s, rt in enumerate(lay["routes"]):
            rows.scatter_rows(x[s][rt.unique_token], rt.unique_dest, rt.unique_offset, 1, tok)
        t0 = time.perf_counter()
        grouped = [ops.expand_rows(tok[d], lay["src_row"][d]) for d in range(R)]
        back = [
            ops.reduce_rows(grouped[d], lay["segs"][d], tok[d].shape[0], w_at[d]) for d in range(R)
        ]
        local = time.perf_counter() - t0
        for rt in lay["routes"]:
            got_UH = torch.empty(rt.sent_rows, H, dtype=torch.bfloat16)
            rows.gather_rows(back, rt.unique_dest, rt.unique_offset, got_UH)
            t0 = time.perf_counter()
            ops.reduce_rows(got_UH, rt.unique_token, S, None, torch.bfloat16)
            local += time.perf_counter() - t0
        local_s.append(local)

    ms_rec, ms_tok = paired_ms([per_record, token_once], reps)
    local_ms = 1e3 * sorted(local_s[1:])[len(local_s[1:]) // 2]
    records = R * S * K
    unique = sum(rt.sent_rows for rt in lay["routes"])
    # bf16 rows in dispatch and combine, less the int64 token row and fp32 weight that
    # token-once sends along with every record
    saved_bytes = 2 * (records - unique) * H * 2 - records * (8 + 4)
    return {
        "scenario": scenario, "R": R, "E": E, "S": S, "K": K, "H": H,
        "rows_per_record": records, "rows_token_once": unique,
        "step_ms_per_record": ms_rec, "step_ms_token_once": ms_tok,
        "local_ms": local_ms, "ratio": ms_tok / ms_rec,
        "saved_mib": saved_bytes / 2**20,
        "break_even_gbps": saved_bytes / (local_ms * 1e-3) / 1e9,
    }  # fmt: skip


# the table's columns: (header, key of one()'s result, format)
COLUMNS = [
    ("scenario", "scenario", "<13"), ("R", "R", ">3"), ("E", "E", ">5"), ("S", "S", ">6"),
    ("K", "K", ">3"), ("H", "H", ">6"), ("rows rec", "rows_per_record", ">10"),
    ("once", "rows_token_once", ">8"), ("saved MiB", "saved_mib", ">10.1f"),
    ("step ms rec", "step_ms_per_record", ">12.1f"), ("once", "step_ms_token_once", ">8.1f"),
    ("ratio", "ratio", ">7.2f"), ("local ms", "local_ms", ">9.1f"),
    ("break-even GB/s", "break_even_gbps", ">16.2f"),
]  # fmt: skip


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="one small configuration (CI smoke)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per version (default 5)")
    ap.add_argument("--out", default=result_path("token_rows.json"), help="JSON output path")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("".join(f"{head:{fmt.split('.')[0]}}" for head, _, fmt in COLUMNS))
    results = []
    for config in QUICK if args.quick else CONFIGS:
        for scenario in SCENARIOS:
            results.append(one(scenario, *config, args.reps))
            print("".join(f"{results[-1][key]:{fmt}}" for _, key, fmt in COLUMNS), flush=True)
    write_json(args.out, {"threads": 1, "rows": results})


if __name__ == "__main__":
    main()
