"""GPU check of the fused planner: correctness against the reference, CUDA graph replay timing.

Legend: R ranks, E experts, S tokens per rank, K top-k, B slots per rank (default M = ceil(E/R)).

Run on a machine with a CUDA device (under 8 minutes on an H200):

    python bench/gpu_check.py            # writes $OUT/gpu_check.json (./gpu_check.json without OUT)

Sections (each one catches and reports its own failure, the script always finishes):
    env        torch, device, cuda-python, ``cuda_backend.available()``
    random     ~200 random cases (with and without ``previous``) vs ``reference_plan``
    graph      capture ``plan_cuda`` in a CUDA graph, replay on new counts, compare
    timing     graph replay time of the cuda and torch backends at the shapes of SHAPES,
               with lognormal (sigma 1) expert popularity; target <= 25 us at (8, 896, 8192, 8)
    runtime    ``bench/gpu_runtime_check.py`` (Triton row kernels vs d2d copy bandwidth,
               grouped experts vs torch.mm, one MoonMoE step, NVSHMEM), writing its own JSON
The table printed last is the summary.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import bench_parser, section  # noqa: E402  (bench/ is the script's folder)

from moonplan.plan import cuda_backend  # noqa: E402
from moonplan.plan.reference import reference_fields  # noqa: E402
from moonplan.tables import render  # noqa: E402

SHAPES = [(8, 896, 8192, 8), (8, 256, 4096, 8), (64, 896, 8192, 8), (256, 896, 2048, 16)]
TARGET_US = 25.0
RANDOM_CASES = 200
REPLAYS = 200

Fields = dict[str, torch.Tensor]


# ---- counts ----------------------------------------------------------------------------------


def lognormal_counts(R: int, E: int, S: int, K: int, seed: int) -> torch.Tensor:
    """int64 ``[R, E]``: per rank a multinomial of ``S*K`` records over a lognormal popularity."""
    if S * K == 0:
        return torch.zeros(R, E, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    pop_E = torch.exp(torch.randn(E, generator=g))  # sigma 1
    idx = torch.multinomial(pop_E.expand(R, E), S * K, replacement=True, generator=g)
    counts_RE = torch.zeros(R, E, dtype=torch.int64)
    return counts_RE.scatter_add_(1, idx, torch.ones_like(idx))


def random_case(rng: random.Random) -> tuple[torch.Tensor, int, int]:
    """Small skewed or adversarial counts with a random ``B`` and ``align``."""
    R = rng.choice([1, 2, 3, 4, 5, 8, 13, 16, 40, 64])
    E = rng.choice([1, 2, 3, 7, 8, 16, 17, 64, 100, 256])
    M = -(-E // R)
    B = rng.choice([0, 1, max(M - 1, 0), M, M + 1])
    align = rng.choice([1, 8, 128])
    kind = rng.choice(["lognormal", "lognormal", "zero", "hot", "ties"])
    counts_RE = torch.zeros(R, E, dtype=torch.int64)
    if kind == "hot":
        counts_RE[:, rng.randrange(E)] = torch.randint(0, 50, (R,))
    elif kind == "ties":
        counts_RE[:] = rng.choice([1, 2, 3])
    elif kind == "lognormal":
        S = rng.choice([0, 1, 7, 64])
        counts_RE = lognormal_counts(R, E, S, rng.choice([1, 2, 8]), rng.randrange(1 << 30))
        for s in range(R):  # some empty source ranks
            if rng.random() < 0.2:
                counts_RE[s] = 0
    return counts_RE, B, align


Prev = tuple[torch.Tensor, torch.Tensor] | None  # (slot_expert [R, B], flow [R-1, 3])


def plan_gpu(counts_RE: torch.Tensor, B: int, align: int, prev: Prev) -> Fields:
    """``plan_cuda`` on CUDA copies of the inputs."""
    slots = flows = None
    if prev is not None:
        slots, flows = prev[0].cuda(), prev[1].cuda()
    return cuda_backend.plan_cuda(counts_RE.cuda(), B, align, slots, flows)


def mismatches(got: Fields, want: Fields) -> list[str]:
    return [k for k, v in want.items() if not torch.equal(got[k].cpu(), v)]


# ---- sections --------------------------------------------------------------------------------


def env_section() -> dict[str, Any]:
    ok, reason = cuda_backend.available()
    info: dict[str, Any] = {"torch": torch.__version__, "available": ok, "reason": reason}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
    try:
        import importlib.metadata as md

        info["cuda_bindings"] = md.version("cuda-bindings")
    except Exception as exc:
        info["cuda_bindings"] = f"unknown ({exc})"
    if ok:
        t0 = time.perf_counter()
        cuda_backend.plan_cuda(torch.ones(2, 4, dtype=torch.int64, device="cuda"), 2, 1, None)
        torch.cuda.synchronize()
        info["first_call_s"] = round(time.perf_counter() - t0, 3)  # NVRTC compile + load
    return info


def random_section() -> dict[str, Any]:
    rng = random.Random(2024)
    bad: list[dict[str, Any]] = []
    n = 0
    for _ in range(RANDOM_CASES):
        counts_RE, B, align = random_case(rng)
        prev: Prev = None
        for _ in range(2):  # without previous, then with this plan as previous
            want = reference_fields(counts_RE, B, align, prev)
            got = plan_gpu(counts_RE, B, align, prev)
            keys = mismatches(got, want)
            n += 1
            if keys and len(bad) < 5:
                bad.append(
                    {
                        "shape": list(counts_RE.shape),
                        "B": B,
                        "align": align,
                        "prev": prev is not None,
                        "fields": keys,
                        "counts": counts_RE.tolist() if counts_RE.numel() <= 64 else None,
                    }
                )
            elif keys:
                bad.append({"fields": keys})
            prev = (want["slot_expert"], want["flow"])
            counts_RE = counts_RE.roll(1, dims=1)  # drifted routing for the second step
    if bad:
        raise AssertionError(f"{len(bad)} of {n} cases differ; first: {bad[:5]}")
    return {"cases": n}


def capture(fn: Callable[[], Fields]) -> tuple[torch.cuda.CUDAGraph, Fields]:
    """Warm up ``fn`` on a side stream, then capture it in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_section() -> dict[str, Any]:
    R, E, S, K = 8, 896, 8192, 8
    B = -(-E // R)
    static_RE = lognormal_counts(R, E, S, K, 0).cuda()
    prev_RB = torch.full((R, B), -1, dtype=torch.int64, device="cuda")
    prev_F3 = torch.full((R - 1, 3), -1, dtype=torch.int64, device="cuda")
    graph, out = capture(lambda: cuda_backend.plan_cuda(static_RE, B, 128, prev_RB, prev_F3))
    for seed in range(1, 6):
        counts_RE = lognormal_counts(R, E, S, K, seed)
        static_RE.copy_(counts_RE)
        want = reference_fields(counts_RE, B, 128, (prev_RB, prev_F3))
        graph.replay()
        torch.cuda.synchronize()
        keys = mismatches(out, want)
        if keys:
            raise AssertionError(f"replay {seed} differs from the reference in {keys}")
        prev_RB.copy_(out["slot_expert"])
        prev_F3.copy_(out["flow"])
    return {"replays_checked": 5}


def time_replay(graph: torch.cuda.CUDAGraph, n: int = REPLAYS) -> float:
    """Mean microseconds per replay (CUDA events around ``n`` back-to-back replays)."""
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / n


def time_eager(fn: Callable[[], Any], n: int = 50) -> float:
    """Mean wall microseconds per call of ``fn`` (host launch path included), synchronised."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / n


def timing_one(R: int, E: int, S: int, K: int) -> dict[str, Any]:
    B = -(-E // R)
    counts_RE = lognormal_counts(R, E, S, K, 7)
    static_RE = counts_RE.cuda()
    row: dict[str, Any] = {"R": R, "E": E, "S": S, "K": K, "B": B}
    graph, out = capture(lambda: cuda_backend.plan_cuda(static_RE, B, 128, None))
    row["cuda_us"] = round(time_replay(graph), 2)
    row["eager_us"] = round(time_eager(lambda: cuda_backend.plan_cuda(static_RE, B, 128, None)), 2)
    row["matches_reference"] = not mismatches(out, reference_fields(counts_RE, B, 128, None))
    try:
        from moonplan.plan.torch_backend import plan_torch

        tgraph, _ = capture(lambda: plan_torch(static_RE, B, 128, None))
        row["torch_us"] = round(time_replay(tgraph, 50), 2)
    except Exception as exc:
        row["torch_us"] = None
        row["torch_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return row


def timing_section() -> dict[str, Any]:
    rows = []
    for shape in SHAPES:
        try:
            rows.append(timing_one(*shape))
        except Exception as exc:
            rows.append(
                dict(zip("RESK", shape, strict=True), error=f"{type(exc).__name__}: {exc}"[:300])
            )
            traceback.print_exc()
    first = rows[0].get("cuda_us")
    return {
        "rows": rows,
        "target_us": TARGET_US,
        "meets_target": first is not None and first <= TARGET_US,
    }


# ---- report ----------------------------------------------------------------------------------


def print_table(results: dict[str, Any]) -> None:
    print("\n== gpu_check summary")
    env = results.get("env", {})
    print(
        f"device: {env.get('device', '-')}  torch {env.get('torch', '-')}  "
        f"cuda-bindings {env.get('cuda_bindings', '-')}  available: {env.get('available')}"
    )
    if not env.get("available"):
        print(f"CUDA planner unavailable: {env.get('reason')}")
    for name in ("env", "random", "graph", "timing"):
        r = results.get(name)
        if r is None:
            print(f"{name:8s} skipped")
            continue
        state = "ok" if r.get("ok") else f"FAILED {r.get('error', '')}"
        print(f"{name:8s} {r.get('seconds', '-')} s {state}")
    rows = [
        [
            *(str(r[k]) for k in "RESK"),
            str(r.get("B", "-")),
            _fmt(r.get("cuda_us")),
            _fmt(r.get("eager_us")),
            _fmt(r.get("torch_us")),
            str(r.get("matches_reference", r.get("error", "-")))[:40],
        ]
        for r in results.get("timing", {}).get("rows", [])
    ]
    header = ["R", "E", "S", "K", "B", "cuda us", "eager us", "torch us", "same as ref"]
    print("\n" + render(header, rows))
    print(f"target: <= {TARGET_US} us at (8, 896, 8192, 8)")


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv: list[str] | None = None) -> int:
    bench_parser(__doc__).parse_args(argv)  # --help prints the docstring and runs nothing
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S")}
    section(results, "env", env_section)
    if results["env"].get("available"):
        section(results, "random", random_section)
        section(results, "graph", graph_section)
        section(results, "timing", timing_section)
        # The runtime's GPU checks (kernels, experts, one layer, NVSHMEM) in their own process.
        runtime = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_runtime_check.py")])
        results["runtime_check"] = {"ok": runtime.returncode == 0, "returncode": runtime.returncode}
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_check.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {path}")
    print_table(results)
    if not results["env"].get("available"):
        return 2
    return 0 if all(r.get("ok") for r in results.values() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
