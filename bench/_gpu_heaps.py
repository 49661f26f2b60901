"""The symmetric heaps on a GPU, for ``bench/gpu_check.py``: ipc and NVSHMEM, and a layer on each.

Legend: R ranks (processes on the one GPU), H hidden, F ffn, E experts, K top-k, T tokens.

:func:`install_nvshmem` (run by ``gpu_check.py`` before any section): nvshmem4py from
the carried wheel (``.whl/nvshmem4py*.whl``, pip without index or deps, into
``/tmp/moonplan-site``, added to ``PYTHONPATH``) unless it is installed already.

:func:`heaps_section`:
    nvshmem4py ``nvshmem.core`` imports (its host library found), its version
    ipc_1      the ipc heap at one rank: allocate, write through ``peer(0)``, read back
    ipc_2      two processes sharing the GPU write each other's rows (spawned, gloo)
    nvshmem_1  the NVSHMEM heap at one PE: allocate, write through ``peer(0)``, read back
    layers     one MoonMoE step (forward and backward, bf16) on the ipc heap and on the
               NVSHMEM heap, same weights and tokens: output and gradients bit for bit
               (the ipc step runs twice: where it does not repeat its own bits, to 1e-2)

NVSHMEM is initialised once per process (uid bootstrap over the loopback interface
unless ``NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME`` says otherwise; ``NVSHMEM_SYMMETRIC_SIZE``
2 GiB unless set): the section runs in its own process. With ``smoke`` (CPU) the ipc
heap runs through the tests' fake mapper, NVSHMEM is skipped, and the layer comparison
is shm against ipc. Ran on an H200 on 2026-12-04 (docs/benchmarks.md).
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SITE = "/tmp/moonplan-site"
NVSHMEM_ENV = {"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo", "NVSHMEM_SYMMETRIC_SIZE": "2G"}


def heaps_section(smoke: bool) -> dict[str, Any]:
    """Every check above; each records its own error, so one failing leaves the others."""
    if smoke:
        with tempfile.TemporaryDirectory(prefix="moonplan-fake-ipc-") as tmp:
            _fake_mapper(tmp)
            return _checks(smoke, torch.device("cpu"))
    return _checks(smoke, torch.device("cuda", 0))


def _checks(smoke: bool, dev: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    checks = [
        ("nvshmem4py", lambda: {"skipped": "cpu"} if smoke else nvshmem_importable()),
        ("ipc_1", lambda: roundtrip("ipc", dev)),
        ("ipc_2", lambda: ipc_two_ranks(smoke)),
        ("nvshmem_1", lambda: {"skipped": "cpu"} if smoke else roundtrip("nvshmem", dev)),
        ("layers", lambda: same_layer_bits(("shm", "ipc") if smoke else ("ipc", "nvshmem"), dev)),
    ]
    for name, fn in checks:
        try:
            out[name] = fn()
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    failed = [k for k, v in out.items() if "error" in v or v.get("ok") is False]
    if failed:
        raise RuntimeError(f"heap checks failed: {failed}: {out}")
    return out


def install_nvshmem() -> dict[str, Any]:
    """Make ``nvshmem`` findable from the carried wheel (module docstring): run by
    ``gpu_check.py`` itself before its sections, so that every section's process (the
    ``pytest`` one too) inherits ``PYTHONPATH`` and the NVSHMEM settings. Imports nothing."""
    for k, v in NVSHMEM_ENV.items():
        os.environ.setdefault(k, v)
    if importlib.util.find_spec("nvshmem") is not None:
        return {"ok": True, "from": "already installed"}
    wheels = sorted(glob.glob(str(ROOT / ".whl" / "nvshmem4py*.whl")))
    if not wheels:
        return {"ok": False, "error": "nvshmem4py is not installed and no .whl/ wheel was carried"}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", SITE, *wheels]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode:
        return {"ok": False, "error": f"pip install failed: {done.stderr[-500:]}"}
    sys.path.insert(0, SITE)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p)
    return {"ok": True, "from": [Path(w).name for w in wheels], "target": SITE}


def nvshmem_importable() -> dict[str, Any]:
    """``nvshmem.core`` imports here (its host library is found), with its version."""
    mod = importlib.import_module("nvshmem.core")
    version = getattr(importlib.import_module("nvshmem"), "__version__", "?")
    return {"ok": True, "version": version, "module": mod.__file__}


def roundtrip(backend: str, dev: torch.device) -> dict[str, Any]:
    """One rank: allocate, write through ``peer(0)``, barrier, read ``local`` back."""
    from moonplan.comm import EPGroup, create_heap

    heap = create_heap(EPGroup(device=dev), 1 << 20, backend=backend)
    want = torch.arange(32.0, device=dev).view(4, 8)
    t = heap.alloc((4, 8), torch.float32)
    t.peer(0).copy_(want)
    heap.barrier()
    same = bool(torch.equal(t.local, want))
    got = {"ok": same, "backend": heap.backend}
    heap.close()
    return got


def _ipc_rank(rank: int, world: int, smoke_dir: str) -> list[float]:
    from moonplan.comm import EPGroup, create_heap

    if smoke_dir:
        _fake_mapper(smoke_dir)
        dev = torch.device("cpu")
    else:
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    heap = create_heap(EPGroup(device=dev), 1 << 16, backend="ipc")
    sym = heap.alloc((world, 4), torch.float32)
    for peer in range(world):
        sym.peer(peer)[rank] = float(rank + 10 * peer)
    heap.barrier()
    got = sym.local[:, 0].cpu().tolist()
    heap.close()
    return got


def ipc_two_ranks(smoke: bool) -> dict[str, Any]:
    """Two ranks (processes sharing the GPU) write a row into each other's heap."""
    from moonplan.testing.dist import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        got = run_ranks(_ipc_rank, 2, tmp if smoke else "", timeout=120,
                        start_method=None if smoke else "spawn")  # fmt: skip
    want = [[float(r + 10 * rank) for r in range(2)] for rank in range(2)]
    return {"ok": got == want, "got": got}


def layer_step(backend: str, dev: torch.device) -> list[torch.Tensor]:
    """One seeded MoonMoE forward and backward on heap ``backend``: ``[y, dx, d gate_up]``."""
    from moonplan import MoonMoE
    from moonplan.comm import EPGroup

    os.environ["MOONPLAN_HEAP"] = backend
    H, F, E, K, T = 256, 128, 8, 2, 64
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    layer = MoonMoE(H, F, E, K, group=EPGroup(device=dev), dtype=dt, transport="heap")
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dev, dt)
    x.requires_grad_(True)
    y = layer(x)
    y.float().square().sum().backward()
    assert layer.last_stats is not None and layer.last_stats.heap == backend
    out = [y.detach().cpu(), x.grad.cpu(), layer.gate_up.grad.cpu()]
    layer.runtime.close()
    del os.environ["MOONPLAN_HEAP"]
    return out


def same_layer_bits(backends: tuple[str, str], dev: torch.device) -> dict[str, Any]:
    """The same step on two heaps: equal bits (the kernels do not depend on the heap). The
    first heap runs twice: if its two runs differ (a non-deterministic kernel), bit
    equality across heaps cannot be asked, and the heaps must agree to 1e-2 instead."""
    a, b, again = (layer_step(name, dev) for name in (*backends, backends[0]))
    same = [bool(torch.equal(x, y)) for x, y in zip(a, b, strict=True)]
    repeat = all(bool(torch.equal(x, y)) for x, y in zip(a, again, strict=True))
    close = all(
        float((x.double() - y.double()).norm() / y.double().norm().clamp(min=1e-30)) < 1e-2
        for x, y in zip(a, b, strict=True)
    )
    ok = all(same) if repeat else close
    return {"ok": ok, "backends": list(backends), "same_y_dx_dgate_up": same, "repeatable": repeat}


def _fake_mapper(directory: str) -> None:
    """CPU smoke runs: the ipc heap over the tests' file-backed fake mapper."""
    sys.path.insert(0, str(ROOT))
    from moonplan.comm.ipc_heap import set_mapper
    from tests.comm.fake_ipc import FileMapper

    set_mapper(FileMapper(directory))
