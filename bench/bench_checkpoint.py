"""What checkpoint verification costs: save and load side by side (R = 2, CPU ranks).

Two ranks (fork, gloo) build a ``MoonMoE`` whose experts hold ``--mib`` MiB in all and time,
interleaved (A B A B ...) in the same processes:

* ``save``: ``checkpoint.save_sharded`` (each shard's CRC-32 computed while it is written,
  renamed into place, the manifest written by rank 0) against ``bare``: ``torch.save`` of
  the same payload to a file per rank, flushed to disk (``fsync``, as ``save_sharded``
  does), then a barrier;
* ``load``: ``checkpoint.load_sharded`` with ``verify=True`` (the default: every file
  checked against the manifest, each file's CRC-32 read by one rank) against
  ``verify=False``.

The files stay in the page cache (they were just written), so reading them is cheap:
this is the worst case for the verification's share; from a cold disk the load reads the
files anyway and the checksum pass reads them once more. Rank 0's median seconds are
reported, with the CRC-32 throughput of one core (``zlib.crc32`` over 256 MiB) and the
checking passes timed alone (save's checksum of its shard, load's collective
verification): on a shared machine the disk's write times vary by 2-4x between runs,
the passes much less.

    OMP_NUM_THREADS=1 python bench/bench_checkpoint.py           # 512 MiB of experts
    python bench/bench_checkpoint.py --quick                     # 32 MiB (smoke test)
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import TextTable, result_path, time_interleaved, timing_parser, write_json

from moonplan.adapters.manifest import file_crc32
from moonplan.testing.dist import run_ranks

H, E, K = 1024, 16, 2  # F follows from --mib: 16 experts of 3 H F fp32 weights


def _layer(mib: int) -> Any:
    from moonplan import MoonMoE

    F = max(1, (mib << 20) // (E * 3 * H * 4))
    torch.manual_seed(0)
    return MoonMoE(H, F, E, K, balance="off", max_tokens=8)


def _rank(rank: int, world: int, mib: int, reps: int, root: str) -> dict[str, Any]:
    from moonplan import checkpoint

    layer = _layer(mib)
    own, bare = Path(root) / "own", Path(root) / "bare"
    bare.mkdir(parents=True, exist_ok=True)
    with checkpoint._home_keys(layer):
        payload = {k: v.detach().clone() for k, v in layer.state_dict().items()}

    def save_bare() -> None:
        with open(bare / f"rank-{rank}.pt", "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())  # flushed to disk as save_sharded's files are
        dist.barrier()

    def save_own() -> None:
        checkpoint.save_sharded(layer, own)

    save_s, bare_s = time_interleaved(save_own, save_bare, reps, warmup=1)
    verified_s, unverified_s = time_interleaved(
        lambda: checkpoint.load_sharded(layer, own),
        lambda: checkpoint.load_sharded(layer, own, verify=False),
        reps,
        warmup=1,
    )
    shard = own / checkpoint.file_name(rank, world)
    crc_s, check_s = time_interleaved(  # the passes themselves: what save and load add
        lambda: file_crc32(shard),
        lambda: checkpoint._verified(layer.group, own),
        reps,
        warmup=1,
    )
    files = sum(p.stat().st_size for p in own.glob("rank-*.pt"))
    return {
        "file_mib": files / 2**20,
        "shard_mib": shard.stat().st_size / 2**20,
        "save_s": statistics.median(save_s),
        "bare_save_s": statistics.median(bare_s),
        "load_verified_s": statistics.median(verified_s),
        "load_unverified_s": statistics.median(unverified_s),
        "save_checksum_s": statistics.median(crc_s),
        "load_verify_s": statistics.median(check_s),
        "samples": {
            "save": save_s,
            "bare": bare_s,
            "verified": verified_s,
            "unverified": unverified_s,
        },
    }


def _crc_gbps() -> float:
    data = os.urandom(256 << 20)
    t0 = time.perf_counter()
    zlib.crc32(data)
    return len(data) / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = timing_parser(__doc__, reps=5, out=result_path("checkpoint.json"))
    ap.add_argument("--mib", type=int, default=512, help="MiB of expert weights in all")
    args = ap.parse_args()
    mib = 32 if args.quick else args.mib
    with tempfile.TemporaryDirectory(prefix="moonplan-bench-ckpt-") as root:
        got = run_ranks(_rank, 2, mib, args.reps, root, timeout=1800)[0]
    crc = _crc_gbps()
    table = TextTable(
        "{what:>10} {with_s:>10.3f} {without_s:>10.3f} {ratio:>7.3f}",
        "phase|checked s|bare s|ratio",
    )
    print(f"R=2 CPU ranks, {got['file_mib']:.0f} MiB of checkpoint files, crc32 {crc:.2f} GB/s")
    print(table.header())
    rows = {
        "save": (got["save_s"], got["bare_save_s"]),
        "load": (got["load_verified_s"], got["load_unverified_s"]),
    }
    for what, (a, b) in rows.items():
        print(table.row({"what": what, "with_s": a, "without_s": b, "ratio": a / b}))
    gib = got["shard_mib"] / 1024
    print(
        f"the passes alone, per rank ({got['shard_mib']:.0f} MiB shard): save's checksum "
        f"{got['save_checksum_s']:.3f} s ({got['save_checksum_s'] / gib:.2f} s/GiB), load's "
        f"verification {got['load_verify_s']:.3f} s ({got['load_verify_s'] / gib:.2f} s/GiB)"
    )
    write_json(args.out, {"mib": mib, "crc32_gbps": crc, **got})


if __name__ == "__main__":
    main()
