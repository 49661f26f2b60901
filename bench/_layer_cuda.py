"""``bench_layer.py --cuda``: the MoonMoE step against static EP on one GPU, in one run.

Legend: R rank processes (sharing the GPU), E experts (all ranks), H hidden, F expert
FFN size, K top-k, S tokens per rank.

Per R in ``--cuda-ranks`` (default 1, 2, 4), R processes on GPU 0 (spawned, gloo
process group, the ``ipc`` heap unless ``--heap`` says otherwise) build one layer per
variant in turn (``static``: ``balance="off"``; ``exact``; ``auto``) with the same
weights, at DeepSeek-V3-like sizes (H = 7168, F = 2048, E = 256 so E/R experts per
rank, top-8, bf16). One variant's layer at a time: weights plus heap take about 68 GB
per variant whatever R (the heap holds home, slot and gradient rows), so three do not
fit together. Each layer runs uniform routing, then lognormal (sigma 1, drifting as
in the CPU bench), at every S of ``--tokens`` (default 16, 256, 1024, 4096): warm-up
steps (auto calibrates in the first ones), then timed forward steps.

Reported per (R, routing, S, variant), rank 0's view: ``wall``, the step between two
barriers with the device synchronised (median); ``host``, the forward call's own host
time (median); the phase split from CUDA events (``moonplan.profile``, aligned steps:
the slowest rank per phase, mean over steps): ``plan``, ``prefetch`` (its side-stream
time) and ``prefetch_exposed``, ``dispatch``, ``experts``, ``combine``; the planned
and static max/mean records per rank; and the ratio of ``wall`` to static's.

How sharing one GPU biases the figures. The R processes share the GPU's SMs and HBM:
their kernels run interleaved, so a rank's experts phase also contains the others'
work, and the step ends when the GPU has done everyone's. Static EP's imbalance
therefore costs far less than on R GPUs (an idle rank's time goes to the busy ones),
while balancing still pays its copies: the ratios understate what balancing gains on
a node. Dispatch, combine and the prefetch move rows within one HBM (several TB/s)
instead of over NVLink, so communication is cheaper than on a node. R = 1 has nothing
to balance (exact equals static): it measures the planner's cost on the critical path.
These runs check the machinery and its overheads on a GPU; the node figures need R
GPUs (``--cuda-ranks`` on a multi-GPU machine gives each rank its own device).

Ran on an H200 on 2026-12-04 (docs/benchmarks.md). ``--cpu-smoke`` runs the same
functions on CPU ranks at tiny sizes (shm heap) to check the code, with meaningless
timings.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from typing import Any

import torch

from moonplan.runtime.routers import softmax_topk
from moonplan.testing.dist import RankError, run_ranks

VARIANTS = {
    "static": {"balance": "off"},
    "exact": {"balance": "exact"},
    "auto": {"balance": "auto"},
}
ROUTINGS = (("uniform", 0.0), ("lognormal", 1.0))
PHASES = ("counts", "plan", "prefetch", "prefetch_exposed", "dispatch", "experts", "combine")
TITLES = ("counts", "plan", "prefetch", "pf.exp", "dispatch", "experts", "combine")
FULL = {"H": 7168, "F": 2048, "E": 256, "K": 8, "tokens": [16, 256, 1024, 4096]}
SMOKE = {"H": 32, "F": 16, "E": 8, "K": 2, "tokens": [4, 16]}


def config(args: Any) -> dict[str, Any]:
    """The run's sizes and options from ``bench_layer.py``'s arguments."""
    cfg = dict(SMOKE if args.cpu_smoke else FULL)
    if args.tokens:
        cfg["tokens"] = [int(s) for s in args.tokens.split(",")]
    ranks = [int(r) for r in args.cuda_ranks.split(",")]
    smoke = args.cpu_smoke
    heap = "" if smoke else args.heap  # the CPU smoke run keeps the default (shm) heap
    cfg |= {"ranks": ranks, "device": "cpu" if smoke else "cuda", "heap": heap}
    cfg |= {"warmup": 2 if smoke else 5, "reps": 2 if smoke else 7, "drift": args.drift}
    return cfg


def _build(name: str, cfg: dict, group: Any, holder: dict) -> Any:
    """Variant ``name``'s layer, its weights the same for every variant."""
    from moonplan import MoonMoE

    H, F, E, K = cfg["H"], cfg["F"], cfg["E"], cfg["K"]
    dev = group.device
    torch.manual_seed(1000 + group.rank)  # the home experts: per rank, same every variant
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    # receive rows for the worst case (every rank's records on one rank): a step never
    # grows them, and growth holds the old heap (weight rows too) beside the new one
    most = group.size * max(cfg["tokens"])
    layer = MoonMoE(H, F, E, K, group=group, dtype=dtype, max_tokens=most,
                    router=lambda x: x, **VARIANTS[name])  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(0)  # the router: the same on every rank
    with torch.no_grad():
        layer.router.weight.normal_(0.0, H**-0.5, generator=g)
    layer.route_fn = lambda x: softmax_topk(layer.router(x).float() + holder["bias"], K)
    return layer


def _biases(cfg: dict, sigma: float, steps: int, dev: torch.device) -> list[torch.Tensor]:
    """Per step log-popularity ``sigma * z_t``, ``z`` an AR(1) of unit variance."""
    g = torch.Generator().manual_seed(1)
    rho = 1.0 - cfg["drift"]
    z = torch.randn(cfg["E"], generator=g)
    out = []
    for _ in range(steps):
        out.append((sigma * z).to(dev))
        z = rho * z + math.sqrt(max(0.0, 1 - rho * rho)) * torch.randn(cfg["E"], generator=g)
    return out


def _sync(group: Any) -> None:
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    group.barrier()


def _one_step(layer: Any, x: torch.Tensor) -> tuple[float, float]:
    """``(wall s, host s)`` of one forward: barrier-to-barrier with the device synchronised,
    and the forward call alone on the host."""
    _sync(layer.group)
    t0 = time.perf_counter()
    with torch.no_grad():
        layer(x)
    t1 = time.perf_counter()
    _sync(layer.group)
    return time.perf_counter() - t0, t1 - t0


def _measure(layer: Any, x: torch.Tensor, biases: list[torch.Tensor], holder: dict, cfg: dict):
    """Warm-up, then timed steps under the profiler: medians, phase means, balance."""
    warm = cfg["warmup"]
    for bias in biases[:warm]:
        holder["bias"] = bias
        _one_step(layer, x)
    walls, hosts, mm = [], [], []
    with layer.profile(aligned=True) as prof:
        for bias in biases[warm:]:
            holder["bias"] = bias
            wall, host = _one_step(layer, x)
            s = layer.last_stats
            walls.append(wall)
            hosts.append(host)
            mm.append((s.planned_max_over_mean, s.static_max_over_mean, s.policy, s.heap))
    summary = prof.report.summary()
    phases = {p: summary[p]["mean_ms"] for p in PHASES if p in summary}
    return {
        "wall_ms": 1e3 * statistics.median(walls),
        "host_ms": 1e3 * statistics.median(hosts),
        "phases_ms": phases,
        "planned_max_over_mean": statistics.mean(m[0] for m in mm),
        "static_max_over_mean": statistics.mean(m[1] for m in mm),
        "policies": sorted({m[2] for m in mm}),
        "heap": mm[0][3],
    }


def _rank(rank: int, world: int, cfg: dict) -> list[dict]:
    """One rank: every variant in turn (one layer alive), both routings, every S."""
    from moonplan.comm import EPGroup

    if cfg["heap"]:
        os.environ["MOONPLAN_HEAP"] = cfg["heap"]
    if cfg["device"] == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        group = EPGroup(device=f"cuda:{index}")
    else:
        torch.set_num_threads(1)
        group = EPGroup()
    steps = cfg["warmup"] + cfg["reps"]
    gen = torch.Generator(device=group.device).manual_seed(10 + rank)
    dtype = torch.bfloat16 if group.device.type == "cuda" else torch.float32
    x_all = torch.randn(max(cfg["tokens"]), cfg["H"], generator=gen, device=group.device)
    x_all = x_all.to(dtype)
    rows = []
    for name in VARIANTS:
        holder = {"bias": torch.zeros(cfg["E"], device=group.device)}
        layer = _build(name, cfg, group, holder)
        for routing, sigma in ROUTINGS:
            biases = _biases(cfg, sigma, steps, group.device)
            for S in cfg["tokens"]:
                got = _measure(layer, x_all[:S], biases, holder, cfg)
                rows.append({"R": world, "routing": routing, "S": S, "variant": name, **got})
        layer.runtime.close()
        del layer
        gc.collect()  # the router closure holds the layer in a cycle
        if group.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run(cfg: dict) -> list[dict]:
    """Every R of ``cfg["ranks"]`` in turn; rank 0's rows with the ratio to static. An R
    whose ranks fail is printed and left out (the others' rows stay; the acceptance then
    lacks it)."""
    rows: list[dict] = []
    for R in cfg["ranks"]:
        spawn = cfg["device"] == "cuda"
        try:
            got = run_ranks(_rank, R, cfg, timeout=600, start_method="spawn" if spawn else None)
        except RankError as exc:
            print(f"R={R} failed, left out: {str(exc)[:600]}")
            continue
        rows += got[0]
    static = {
        (r["R"], r["routing"], r["S"]): r["wall_ms"] for r in rows if r["variant"] == "static"
    }
    for r in rows:
        r["ratio_vs_static"] = r["wall_ms"] / static[(r["R"], r["routing"], r["S"])]
    return rows


def table(rows: list[dict]) -> list[str]:
    """Text lines: one row per (R, routing, S, variant)."""
    head = f"{'R':>2} {'routing':>9} {'S':>5} {'variant':>7} {'wall ms':>8} {'/static':>7} "
    head += f"{'host ms':>8} " + " ".join(f"{t:>8}" for t in TITLES) + "  max/mean  policies"
    heaps = sorted({r["heap"] or "none" for r in rows})
    lines = [f"phases: CUDA-event ms, slowest rank, mean; max/mean: planned/static; heap {heaps}"]
    lines.append(head)
    for r in rows:
        ph = r["phases_ms"]
        cells = " ".join(f"{ph[p]:>8.3f}" if p in ph else f"{'-':>8}" for p in PHASES)
        lines.append(
            f"{r['R']:>2} {r['routing']:>9} {r['S']:>5} {r['variant']:>7} {r['wall_ms']:>8.3f} "
            f"{r['ratio_vs_static']:>7.3f} {r['host_ms']:>8.3f} {cells}  "
            f"{r['planned_max_over_mean']:.2f}/{r['static_max_over_mean']:.2f}  "
            f"{','.join(r['policies'])}"
        )
    return lines


def acceptance(rows: list[dict]) -> dict[str, Any]:
    """The step-bench bars on the largest R: auto / static at uniform routing (every S),
    and at lognormal from 1024 tokens per rank."""
    if not rows:
        return {}
    R = max(r["R"] for r in rows)
    auto = [r for r in rows if r["R"] == R and r["variant"] == "auto"]
    uni = [r["ratio_vs_static"] for r in auto if r["routing"] == "uniform"]
    logn = [r["ratio_vs_static"] for r in auto if r["routing"] == "lognormal" and r["S"] >= 1024]
    return {
        "R": R,
        "uniform_worst": max(uni, default=float("nan")),
        "uniform_bar": 1.02,
        "lognormal_from_1024_worst": max(logn, default=float("nan")),
        "lognormal_bar": "< 1",
        "shared_gpu": "ranks share one GPU: ratios understate balancing (see the docstring)",
    }
