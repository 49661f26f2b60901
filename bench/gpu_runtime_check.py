"""GPU check of the runtime: row-movement kernels, grouped experts, one MoonMoE step.

Legend: N records, H hidden, F expert FFN size, G groups (experts), R "peers".

On a CUDA machine (part of the prepared GPU run, a few minutes on an H200)::

    python bench/gpu_runtime_check.py                  # writes $OUT/gpu_runtime_check.json

Sections (each catches and reports its own failure):
    kernels   Triton scatter / gather vs their torch twins (bit equality) and
              their bandwidth as a share of a device-to-device copy of the same bytes
              (peers are separate buffers on this GPU; target >= 70%)
    experts   grouped SwiGLU (torch._grouped_mm, bf16) at H=7168, F=2048 as a share of the
              torch.mm bf16 rate on the same FLOPs (target >= 60%)
    layer     one MoonMoE on one rank, bf16, forward + backward vs the dense formula
    nvshmem   a one-PE NVSHMEM heap: allocate, write through peer(0), read back

``--cpu-smoke`` runs the same code on CPU at tiny sizes (Triton interpreted) to
check the script itself; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import section  # noqa: E402  (bench/ is the script's folder)


def timed(fn: Callable[[], Any], dev: torch.device, n: int) -> float:
    """Median seconds of ``fn`` over ``n`` runs (CUDA events on GPU)."""
    fn()
    times = []
    for _ in range(n):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def kernels_section(dev: torch.device, N: int, H: int, R: int, reps: int) -> dict:
    from moonplan.runtime.row_ops import torch as rows
    from moonplan.runtime.row_ops import triton as kernels

    g = torch.Generator().manual_seed(0)
    K = 2
    x_SH = torch.randn(N // K, H, generator=g).to(dev, torch.bfloat16)
    cap = N // R + 1
    dest_N = (torch.arange(N) % R).to(dev)
    off_N = torch.arange(N).to(dev) // R  # unique (rank, offset) pairs
    views_k = [torch.zeros(cap, H, dtype=torch.bfloat16, device=dev) for _ in range(R)]
    views_t = [v.clone() for v in views_k]
    kernels.scatter_rows(x_SH, dest_N, off_N, K, views_k)
    rows.scatter_rows(x_SH, dest_N, off_N, K, views_t)
    same_scatter = all(torch.equal(a, b) for a, b in zip(views_k, views_t, strict=True))
    dst_k = torch.empty(N, H, dtype=torch.bfloat16, device=dev)
    dst_t = torch.empty_like(dst_k)
    kernels.gather_rows(views_k, dest_N, off_N, dst_k)
    rows.gather_rows(views_t, dest_N, off_N, dst_t)
    nbytes = N * H * 2
    src, dst = (
        torch.empty(N, H, dtype=torch.bfloat16, device=dev),
        torch.empty(N, H, dtype=torch.bfloat16, device=dev),
    )
    t_copy = timed(lambda: dst.copy_(src), dev, reps)
    t_scatter = timed(
        lambda: kernels.scatter_rows(x_SH, dest_N, off_N, K, views_k, check=False), dev, reps
    )
    t_gather = timed(
        lambda: kernels.gather_rows(views_k, dest_N, off_N, dst_k, check=False), dev, reps
    )
    return {
        "N": N,
        "H": H,
        "R": R,
        "same_scatter": same_scatter,
        "same_gather": bool(torch.equal(dst_k, dst_t)),
        "copy_GBps": nbytes / t_copy / 1e9,
        "scatter_share": t_copy / t_scatter,
        "gather_share": t_copy / t_gather,
    }


def experts_section(dev: torch.device, T: int, H: int, F: int, G: int, reps: int) -> dict:
    from moonplan.runtime.experts import grouped_swiglu

    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(T, H, generator=g) * 0.1).to(dev, dt)
    gu = (torch.randn(G, 2 * F, H, generator=g) * H**-0.5).to(dev, dt)
    dn = (torch.randn(G, H, F, generator=g) * F**-0.5).to(dev, dt)
    offs = torch.linspace(0, T, G + 1).long().to(dev)
    flops = 2 * T * H * 3 * F
    t_grouped = timed(lambda: grouped_swiglu(x, offs, gu, dn, check=False), dev, reps)
    a, b = torch.randn(T, H, device=dev, dtype=dt), torch.randn(H, 3 * F, device=dev, dtype=dt)
    t_mm = timed(lambda: a @ b, dev, reps)
    return {
        "T": T,
        "H": H,
        "F": F,
        "G": G,
        "grouped_TFLOPs": flops / t_grouped / 1e12,
        "mm_TFLOPs": flops / t_mm / 1e12,
        "share_of_mm": t_mm / t_grouped,
    }


def layer_section(dev: torch.device, T: int, H: int, F: int, E: int, K: int) -> dict:
    import torch.nn.functional as F_

    from moonplan import MoonMoE
    from moonplan.comm.group import EPGroup

    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    layer = MoonMoE(H, F, E, K, group=EPGroup(device=dev), dtype=dt, transport="a2a")
    x = (torch.randn(T, H, device=dev) * 0.5).to(dt).requires_grad_(True)
    y = layer(x)
    y.float().square().mean().backward()
    with torch.no_grad():
        prob = torch.softmax((x @ layer.router.weight.T).float(), -1)
        w, ids = torch.topk(prob, K, -1)
        w = w / w.sum(-1, keepdim=True)
        want = torch.zeros(T, H, device=dev)
        for k in range(K):
            gu = torch.einsum("th,tfh->tf", x.float(), layer.gate_up[ids[:, k]].float())
            h = F_.silu(gu[:, :F]) * gu[:, F:]
            want += w[:, k, None] * torch.einsum("tf,thf->th", h, layer.down[ids[:, k]].float())
    err = float((y.detach().float() - want).abs().max() / want.abs().max().clamp(min=1e-6))
    stats = layer.last_stats
    return {
        "max_rel_err": err,
        "grads_finite": bool(torch.isfinite(layer.gate_up.grad).all())
        and bool(torch.isfinite(x.grad).all()),
        "phases_ms": {k: round(v * 1e3, 3) for k, v in (stats.phases.items() if stats else [])},
    }


def nvshmem_section(dev: torch.device) -> dict:
    from moonplan.comm import nvshmem_heap
    from moonplan.comm.group import EPGroup
    from moonplan.comm.heap_factory import create_heap

    ok, why = nvshmem_heap.available()
    if not ok:
        return {"skipped": why}
    heap = create_heap(EPGroup(device=dev), 1 << 20, backend="nvshmem")
    t = heap.alloc((4, 8), torch.float32)
    t.peer(0).copy_(torch.arange(32.0, device=dev).view(4, 8))
    heap.barrier()
    same = bool(torch.equal(t.local, torch.arange(32.0, device=dev).view(4, 8)))
    heap.close()
    return {"roundtrip": same}


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="tiny sizes on CPU (Triton interpreted)"
    )
    args = ap.parse_args()
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dev, big = torch.device("cpu"), False
    elif torch.cuda.is_available():
        dev, big = torch.device("cuda", 0), True
        torch.cuda.set_device(dev)
    else:
        print("gpu_runtime_check: no CUDA device (use --cpu-smoke to check the script on CPU)")
        return 2
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": str(dev)}
    if dev.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(dev)
    n, h = (65536, 7168) if big else (64, 16)
    section(
        results, "kernels", lambda: kernels_section(dev, n, h, 8 if big else 3, 20 if big else 2)
    )
    sizes = (8192, 7168, 2048, 8) if big else (64, 16, 8, 4)
    section(results, "experts", lambda: experts_section(dev, *sizes, 20 if big else 2))
    layer_sizes = (4096, 1024, 512, 16, 2) if big else (24, 16, 8, 6, 2)
    section(results, "layer", lambda: layer_section(dev, *layer_sizes))
    section(
        results,
        "nvshmem",
        lambda: nvshmem_section(dev) if dev.type == "cuda" else {"skipped": "cpu"},
    )
    out = Path(os.environ.get("OUT", ".")) / "gpu_runtime_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {out}")
    print("\n== gpu_runtime_check summary")
    for name in ("kernels", "experts", "layer", "nvshmem"):
        r = dict(results.get(name, {}))
        r.pop("phases_ms", None)
        print(
            f"{name:8s} "
            + ", ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
            )
        )
    print("targets: kernels >= 0.70 of a d2d copy; experts >= 0.60 of torch.mm (bf16)")
    return 0 if all(r.get("ok") for r in results.values() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
