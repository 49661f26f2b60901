"""GPU check of the runtime: row-movement kernels, grouped experts, one MoonMoE step.

Legend: N records, H hidden, F expert FFN size, G groups (experts), R "peers", T tokens.

On a CUDA machine (``bench/gpu_check.py`` runs these sections, a minute or two on an H200)::

    python bench/gpu_runtime_check.py                  # writes $OUT/gpu_runtime_check.json

Sections (each catches and reports its own failure):
    kernels   record rows: Triton scatter / gather vs their torch twins (bit equality), and
              their bandwidth as a share of a device-to-device copy of the same rows, for the
              default tile and a few others (``row_ops.triton.Blocks``; peers are separate
              buffers on this GPU); token rows: expand_rows and reduce_rows likewise
              (target >= 70% for each)
    experts   SwiGLU at H=7168, F=2048, 8 experts, 8192 rows, bf16, forward: torch._grouped_mm
              (``grouped_swiglu``) and the Triton grouped GEMM (``runtime.grouped_gemm``, each
              tile candidate), as a share of torch.mm on the same FLOPs (target >= 70%)
    layer     one MoonMoE on one rank, bf16, forward + backward vs the dense formula

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

TARGET = 0.70  # share of a device copy (row kernels) and of torch.mm (experts)


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


def _tiles() -> list[Any]:
    from moonplan.runtime.row_ops.triton import Blocks

    return [Blocks(), Blocks(8, 1024, 8), Blocks(2, 2048, 4), Blocks(1, 1024, 4), Blocks(16, 128)]


def kernels_section(dev: torch.device, N: int, H: int, R: int, reps: int) -> dict:
    """Record rows: bit equality with the twins at the default tile, then each tile's
    share of a copy of the same ``[N, H]`` bf16 rows."""
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
    src, dst = torch.empty_like(dst_k), torch.empty_like(dst_k)
    t_copy = timed(lambda: dst.copy_(src), dev, reps)
    tiles = []
    for b in _tiles():
        t_s = timed(lambda b=b: kernels.scatter_rows(x_SH, dest_N, off_N, K, views_k, check=False,
                                                      blocks=b), dev, reps)  # fmt: skip
        t_g = timed(lambda b=b: kernels.gather_rows(views_k, dest_N, off_N, dst_k, check=False,
                                                     blocks=b), dev, reps)  # fmt: skip
        tile = [b.rows, b.cols, b.warps]
        tiles.append({"tile": tile, "scatter_share": t_copy / t_s, "gather_share": t_copy / t_g})
    return {
        "N": N, "H": H, "R": R, "aligned": kernels._aligned(views_k, views_k[0].stride(0)),
        "same_scatter": same_scatter, "same_gather": bool(torch.equal(dst_k, dst_t)),
        "copy_GBps": N * H * 2 / t_copy / 1e9,
        "scatter_share": tiles[0]["scatter_share"], "gather_share": tiles[0]["gather_share"],
        "tiles": tiles,
    }  # fmt: skip


def token_rows_section(dev: torch.device, T: int, K: int, H: int, reps: int) -> dict:
    """Token rows (top-``K``): ``expand_rows`` (``[T, H]`` -> ``[T*K, H]``) and weighted
    ``reduce_rows`` (back to ``[T, H]``), bits against the twins, each as a share of a
    copy of the ``[T*K, H]`` bf16 rows they read or write."""
    from moonplan.runtime.row_ops import token_torch as ref
    from moonplan.runtime.row_ops import token_triton as ker

    g = torch.Generator().manual_seed(2)
    P = T * K
    tok = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    idx = torch.randperm(P, generator=g).to(dev) % T  # every token K times, shuffled
    rows_PH = torch.randn(P, H, generator=g).to(dev, torch.bfloat16)
    w_P = torch.rand(P, generator=g).to(dev)
    seg = ref.segments(idx, T)
    same_expand = torch.equal(ker.expand_rows(tok, idx), ref.expand_rows(tok, idx))
    got = ker.reduce_rows(rows_PH, seg, T, w_P, torch.bfloat16)
    same_reduce = torch.equal(got, ref.reduce_rows(rows_PH, seg, T, w_P, torch.bfloat16))
    out = torch.empty(P, H, dtype=torch.bfloat16, device=dev)
    t_copy = timed(lambda: out.copy_(rows_PH), dev, reps)
    t_expand = timed(lambda: ker.expand_rows(tok, idx, out, check=False), dev, reps)
    t_reduce = timed(lambda: ker.reduce_rows(rows_PH, seg, T, w_P, torch.bfloat16), dev, reps)
    return {
        "T": T, "K": K, "H": H, "same_expand": same_expand, "same_reduce": same_reduce,
        "expand_share": t_copy / t_expand, "reduce_share": t_copy / t_reduce,
    }  # fmt: skip


def _triton_swiglu(x: torch.Tensor, ends: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor,
                   tiles: Any) -> torch.Tensor:  # fmt: skip
    from moonplan.runtime.grouped_gemm import grouped_mm

    F = gu.shape[1] // 2
    h = grouped_mm(x, gu, ends, tiles=tiles)
    return grouped_mm(torch.nn.functional.silu(h[:, :F]) * h[:, F:], dn, ends, tiles=tiles)


def experts_section(dev: torch.device, T: int, H: int, F: int, G: int, reps: int) -> dict:
    """The SwiGLU forward through torch._grouped_mm and through the Triton grouped GEMM (each
    tile candidate), in TFLOP/s and as a share of torch.mm on the same FLOPs."""
    from moonplan.runtime.experts import grouped_swiglu
    from moonplan.runtime.grouped_gemm import CANDIDATES

    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(T, H, generator=g) * 0.1).to(dev, dt)
    gu = (torch.randn(G, 2 * F, H, generator=g) * H**-0.5).to(dev, dt)
    dn = (torch.randn(G, H, F, generator=g) * F**-0.5).to(dev, dt)
    offs = torch.linspace(0, T, G + 1).long().to(dev)
    ends = offs[1:].to(torch.int32)
    flops = 2 * T * H * 3 * F
    want = grouped_swiglu(x, offs, gu, dn, check=False)
    t_grouped = timed(lambda: grouped_swiglu(x, offs, gu, dn, check=False), dev, reps)
    a, b = torch.randn(T, H, device=dev, dtype=dt), torch.randn(H, 3 * F, device=dev, dtype=dt)
    t_mm = timed(lambda: a @ b, dev, reps)
    triton = []
    for tiles in CANDIDATES if dev.type == "cuda" else CANDIDATES[-1:]:
        got = _triton_swiglu(x, ends, gu, dn, tiles)
        err = float((got.float() - want.float()).norm() / want.float().norm())
        t = timed(lambda tiles=tiles: _triton_swiglu(x, ends, gu, dn, tiles), dev, reps)
        tile = [tiles.m, tiles.n, tiles.k, tiles.warps, tiles.stages]
        triton.append({"tile": tile, "TFLOPs": flops / t / 1e12, "share_of_mm": t_mm / t,
                       "rel_err_vs_grouped_mm": err})  # fmt: skip
    best = max(triton, key=lambda r: r["share_of_mm"])
    return {
        "T": T, "H": H, "F": F, "G": G,
        "grouped_TFLOPs": flops / t_grouped / 1e12, "mm_TFLOPs": flops / t_mm / 1e12,
        "share_of_mm": t_mm / t_grouped, "triton_best_share": best["share_of_mm"],
        "triton_best_tile": best["tile"], "triton": triton,
    }  # fmt: skip


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


def sections(dev: torch.device) -> list[tuple[str, Callable[[], dict]]]:
    """The named sections at the device's sizes (tiny on CPU)."""
    big = dev.type == "cuda"
    reps = 20 if big else 2
    k_sizes = (65536, 7168, 8) if big else (64, 16, 3)
    t_sizes = (8192, 8, 7168) if big else (12, 4, 16)
    e_sizes = (8192, 7168, 2048, 8) if big else (64, 16, 8, 4)
    l_sizes = (4096, 1024, 512, 16, 2) if big else (24, 16, 8, 6, 2)
    return [
        ("kernels", lambda: kernels_section(dev, *k_sizes, reps)),
        ("token_rows", lambda: token_rows_section(dev, *t_sizes, reps)),
        ("experts", lambda: experts_section(dev, *e_sizes, reps)),
        ("layer", lambda: layer_section(dev, *l_sizes)),
    ]


def device(cpu_smoke: bool) -> torch.device | None:
    """The device to check (``None``: no CUDA and no smoke run)."""
    if cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        return None
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="tiny sizes on CPU (Triton interpreted)"
    )
    dev = device(ap.parse_args().cpu_smoke)
    if dev is None:
        print("gpu_runtime_check: no CUDA device (use --cpu-smoke to check the script on CPU)")
        return 2
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": str(dev)}
    for name, fn in sections(dev):
        section(results, name, fn)
    out = Path(os.environ.get("OUT", ".")) / "gpu_runtime_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {out}")
    print(f"targets: row kernels >= {TARGET:.0%} of a copy; experts >= {TARGET:.0%} of torch.mm")
    return 0 if all(r.get("ok") for r in results.values() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
