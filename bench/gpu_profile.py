"""Where the time goes, for the two GPU figures that miss their targets.

    python bench/gpu_profile.py               # both parts, tables, JSON (and pstats text) in $OUT
    python bench/gpu_profile.py --cpu-smoke   # the same code on CPU, tiny (CI)

Legend: R ranks, E experts, S tokens per rank, K top-k, B slots per rank.

Parts:
    choice  ``plan(policy="auto")`` on the GPU at ``_gpu_choice.AUTO_SHAPES``, both paths
            (full, exit): every kernel it launches, with its device microseconds per call
            (``torch.profiler``), so the fused choice kernel's three launches stand beside
            whatever else the call runs.
    layer   one process, one ``MoonMoE`` step at DeepSeek-V3 sizes (H 7168, F 2048, E 256,
            top-8) for each balance mode at 16 and 1024 tokens: the forward's host and wall
            milliseconds, the kernels launched per step, and the host functions that
            take the time (``cProfile``, the top entries by own time and by cumulative time).

Outputs in ``$OUT`` (``./gpu_profile_out`` without it): ``gpu_profile.json`` and
``layer_pstats.txt``. Written for the 2026-12-04 device session (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

LAYER = {"H": 7168, "F": 2048, "E": 256, "K": 8, "tokens": [16, 1024]}
LAYER_SMOKE = {"H": 32, "F": 16, "E": 8, "K": 2, "tokens": [4]}
STEPS, WARM = 20, 5


def kernel_table(prof: Any, calls: int) -> list[dict[str, Any]]:
    """Device microseconds per call of every kernel (and device copy) the profiled region
    ran: the events on the CUDA device, not the host ops that launched them."""
    cuda = torch.autograd.DeviceType.CUDA
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if ev.device_type != cuda or dev_us <= 0:
            continue
        rows.append({"kernel": ev.key[:90], "launches_per_call": ev.count / calls,
                     "us_per_call": dev_us / calls})  # fmt: skip
    rows.sort(key=lambda r: -r["us_per_call"])
    return rows


def choice_part(smoke: bool) -> list[dict[str, Any]]:
    """Per shape and path: the kernels of one ``plan(policy="auto")`` call."""
    from _gpu_choice import AUTO_SHAPES, forced
    from _gpu_planner import lognormal_counts

    import moonplan

    dev = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    shapes = [(4, 16, 64, 2)] if smoke else AUTO_SHAPES
    out = []
    for R, E, S, K in shapes:
        B = min(2, -(-E // R))
        counts_RE = lognormal_counts(R, E, S, K, 7).to(dev)
        prev = moonplan.plan(lognormal_counts(R, E, S, K, 6).to(dev), slots=B, align=128)
        for path in ("full", "exit"):
            opts = {"slots": B, "align": 128, "previous": prev, "policy": "auto"}
            opts["cost"] = forced(path)
            for _ in range(3):
                moonplan.plan(counts_RE, check_input=False, **opts)
            calls = 10
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with profile(activities=acts) as prof:
                for _ in range(calls):
                    moonplan.plan(counts_RE, check_input=False, **opts)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            kernels = kernel_table(prof, calls) if dev.type == "cuda" else []
            total = sum(k["us_per_call"] for k in kernels)
            launches = sum(k["launches_per_call"] for k in kernels)
            out.append({"shape": [R, E, S, K], "path": path, "device_us": round(total, 1),
                        "launches": launches, "kernels": kernels[:12]})  # fmt: skip
    return out


def _step_times(layer: Any, x: torch.Tensor) -> tuple[float, float]:
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        layer(x)
    t1 = time.perf_counter()
    sync()
    return 1e3 * (time.perf_counter() - t0), 1e3 * (t1 - t0)


def _layer_rank(rank: int, world: int, cfg: dict[str, Any], pstats_path: str) -> list[dict]:
    """One process: every balance mode and token count; cProfile of the timed steps."""
    import _layer_cuda

    from moonplan.comm import EPGroup

    cuda = cfg["device"] == "cuda"
    group = EPGroup(device="cuda:0") if cuda else EPGroup()
    dtype = torch.bfloat16 if cuda else torch.float32
    x_all = torch.randn(max(cfg["tokens"]), cfg["H"], device=group.device).to(dtype)
    rows, texts = [], []
    for name in _layer_cuda.VARIANTS:
        holder = {"bias": torch.zeros(cfg["E"], device=group.device)}
        layer = _layer_cuda._build(name, cfg, group, holder)
        for S in cfg["tokens"]:
            x = x_all[:S]
            for _ in range(WARM):
                _step_times(layer, x)
            prof = cProfile.Profile()
            walls, hosts = [], []
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as tprof:
                prof.enable()
                for _ in range(STEPS):
                    w, h = _step_times(layer, x)
                    walls.append(w)
                    hosts.append(h)
                prof.disable()
            launches = sum(e.count for e in tprof.key_averages() if e.key in LAUNCH_KEYS)
            kernels = kernel_table(tprof, STEPS) if cuda else []
            rows.append({"variant": name, "S": S, "wall_ms": statistics.median(walls),
                         "host_ms": statistics.median(hosts),
                         "launches_per_step": launches / STEPS,
                         "device_ms": sum(k["us_per_call"] for k in kernels) / 1e3,
                         "kernels": kernels[:15]})  # fmt: skip
            texts.append(_pstats_text(prof, f"{name} S={S}"))
        layer.runtime.close()
        del layer
    Path(pstats_path).write_text("\n".join(texts))
    return rows


LAUNCH_KEYS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}


def _pstats_text(prof: cProfile.Profile, title: str) -> str:
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    buf.write(f"===== {title}: {STEPS} steps, by own time\n")
    stats.sort_stats("tottime").print_stats(25)
    buf.write(f"===== {title}: by cumulative time\n")
    stats.sort_stats("cumulative").print_stats(35)
    return buf.getvalue()


def layer_part(smoke: bool, out_dir: Path) -> list[dict[str, Any]]:
    """The layer's host profile in one spawned rank (a real process group)."""
    from moonplan.testing.dist import run_ranks

    cuda = torch.cuda.is_available() and not smoke
    cfg = dict(LAYER_SMOKE if smoke else LAYER)
    cfg["device"] = "cuda" if cuda else "cpu"
    path = str(out_dir / "layer_pstats.txt")
    got = run_ranks(_layer_rank, 1, cfg, path, timeout=400, start_method="spawn")
    return got[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="both parts on CPU, tiny")
    ap.add_argument("--parts", default="choice,layer")
    args = ap.parse_args(argv)
    out_dir = Path(os.environ.get("OUT") or ROOT / "gpu_profile_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"torch": torch.__version__}
    if "choice" in args.parts:
        result["choice"] = choice_part(args.cpu_smoke)
        for r in result["choice"]:
            top = ", ".join(f"{k['kernel'][:40]} {k['us_per_call']:.1f}" for k in r["kernels"][:4])
            print(f"choice {r['shape']} {r['path']}: {r['device_us']} us device, "
                  f"{r['launches']:.0f} launches; top: {top}")  # fmt: skip
    if "layer" in args.parts:
        result["layer"] = layer_part(args.cpu_smoke, out_dir)
        for r in result["layer"]:
            top = ", ".join(f"{k['kernel'][:36]} {k['us_per_call']:.0f}" for k in r["kernels"][:5])
            print(f"layer {r['variant']:>6} S={r['S']:>5}: wall {r['wall_ms']:.2f} ms, host "
                  f"{r['host_ms']:.2f} ms, device {r['device_ms']:.2f} ms, "
                  f"{r['launches_per_step']:.0f} launches/step; top us: {top}")  # fmt: skip
    (out_dir / "gpu_profile.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out_dir / 'gpu_profile.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
