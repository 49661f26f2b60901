"""The prepared GPU run: every GPU check of moonplan in one script, under 8 minutes on an H200.

    python bench/gpu_check.py                       # every section, table last, JSON in $OUT
    python bench/gpu_check.py --resume              # only the sections not yet ok (--state)
    python bench/gpu_check.py --sections heaps,step # some sections
    python bench/gpu_check.py --cpu-smoke           # every section's code on CPU, tiny (CI)

Sections, most valuable first. Each runs in its own process with a time box (a hang,
a crash or an NVSHMEM that cannot be finalised stays there) and fails alone:
    env       torch, Triton, cuda-bindings, nvshmem4py, the device, the ipc mapper
    heaps     ipc heap at 1 and 2 ranks, NVSHMEM at 1 PE, one layer step on each heap, bit
              for bit (bench/_gpu_heaps.py; the carried nvshmem4py wheel is installed
              before any section, so that pytest's NVSHMEM tests find it too)
    pytest    pytest -m gpu tests: the multi-rank tests on one GPU among them
    step      bench/bench_layer.py --cuda: R = 1, 2, 4 processes on the GPU, static, exact
              and auto, uniform and lognormal routing (bench/_layer_cuda.py)
    runtime   record-row and token-row kernels vs a device copy, the experts through
              torch._grouped_mm and the Triton grouped GEMM vs torch.mm, one layer
              (bench/gpu_runtime_check.py)
    planner   the fused planner kernel (random cases, graph replay, timing), the public
              plan() per policy, eager and in graph replay (bench/_gpu_planner.py), the
              choice kernel against the reference and policy="auto" on both paths (full,
              exit): host, eager and graph-replay times against the targets (bench/_gpu_choice.py)

Time. ``--budget-s`` (default 480) bounds the whole run; a section gets its own box or
what is left, whichever is less, and one that cannot start in time is skipped. After
every section the results are saved to ``--state`` (default
``bench/results/gpu_check_state.json``, kept on a warm device machine between calls),
so ``--resume`` reruns only what failed or did not run.

Outputs in ``$OUT`` (``./gpu_check_out`` without it): ``gpu_check.json`` (every
section's result), ``sections.log`` (their output) and ``bench_layer_cuda.json``.
Exit status: 0 every section ok, 1 some failed or were skipped, 2 no CUDA device.
Ran whole on an H200 on 2026-12-04 (docs/benchmarks.md); the CPU smoke mode runs every
section's code in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import bench_parser, gated_sections, section  # noqa: E402  (bench/ is the script's folder)

BOXES = {"env": 30, "heaps": 75, "pytest": 170, "step": 120, "runtime": 100, "planner": 120}
SMOKE_PYTEST = ["tests/comm/test_ipc_heap.py", "tests/runtime/test_layer_ipc.py"]
LOG_TAIL = 200_000  # characters of each section's output kept in sections.log


def parse(argv: list[str] | None) -> Any:
    ap = bench_parser(__doc__)
    ap.add_argument("--cpu-smoke", action="store_true", help="every section on CPU, tiny")
    ap.add_argument("--sections", default=",".join(BOXES), help="comma-separated subset")
    ap.add_argument("--resume", action="store_true", help="skip sections already ok in --state")
    ap.add_argument("--budget-s", type=float, default=480.0, help="seconds for the whole run")
    ap.add_argument("--state", default=str(ROOT / "bench" / "results" / "gpu_check_state.json"))
    ap.add_argument("--box", action="append", default=[], metavar="NAME=S",
                    help="another time box for a section (repeatable)")  # fmt: skip
    ap.add_argument("--section", help=argparse.SUPPRESS, default=None)  # a child's section
    ap.add_argument("--section-out", help=argparse.SUPPRESS, default=None)
    args = ap.parse_args(argv)
    unknown = [s for s in args.sections.split(",") if s and s not in BOXES]
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {list(BOXES)}")
    args.boxes = dict(BOXES)
    for item in args.box:
        name, _, seconds = item.partition("=")
        if name not in BOXES or not seconds.replace(".", "", 1).isdigit():
            ap.error(f"--box {item!r}: expected NAME=SECONDS with NAME in {list(BOXES)}")
        args.boxes[name] = float(seconds)
    return args


# ---- the sections that run in a child process (``--section NAME``) ----------------------------
def run_child(name: str, out_path: str, smoke: bool) -> int:
    """Run section ``name`` here and write its result JSON to ``out_path``."""
    results: dict[str, Any] = {}
    if name == "heaps":
        import _gpu_heaps

        section(results, "heaps", lambda: _gpu_heaps.heaps_section(smoke))
        results = results["heaps"]
    elif name == "runtime":
        import gpu_runtime_check as rc

        dev = rc.device(smoke)
        for sub, fn in rc.sections(dev) if dev is not None else []:
            section(results, sub, fn)
    elif name == "planner":
        import _gpu_choice as gc
        import _gpu_decision as gd
        import _gpu_planner as gp

        from moonplan.plan import choice_cuda, cuda_backend

        kernels = [  # the CUDA kernels' sections, each where its backend is available
            ("kernel", cuda_backend.available, "cuda planner", gp.KERNEL_SECTIONS),
            ("choice", choice_cuda.available, "cuda choice", gc.CHOICE_SECTIONS),
        ]
        if not smoke:
            for key, available, what, sections in kernels:
                gated_sections(results, key, available(), what, sections)
        section(results, "api", lambda: gp.api_section(smoke))
        section(results, "auto", lambda: gc.auto_section(smoke))
        section(results, "decision", lambda: gd.decision_section(smoke))
    Path(out_path).write_text(json.dumps(results, indent=1, default=str))
    return 0


def command(name: str, args: Any, out_dir: Path, result_path: str) -> list[str]:
    """The command line of section ``name``."""
    py, smoke = sys.executable, ["--cpu-smoke"] if args.cpu_smoke else []
    if name == "pytest":
        where = SMOKE_PYTEST if args.cpu_smoke else ["tests"]
        return [py, "-m", "pytest", "-m", "gpu", *where, "-q", "-p", "no:cacheprovider"]
    if name == "step":
        out = ["--out", str(out_dir / "bench_layer_cuda.json")]
        small = ["--cuda-ranks", "1,2", "--tokens", "8"] if args.cpu_smoke else []
        return [py, str(ROOT / "bench" / "bench_layer.py"), "--cuda", *smoke, *small, *out]
    script = str(Path(__file__).resolve())
    return [py, script, "--section", name, "--section-out", result_path, *smoke]


def run_process(cmd: list[str], box: float) -> tuple[int | None, str, float]:
    """``(exit status or None if killed at the box, output, seconds)``; a process group, so
    ranks it spawned die with it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=box)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = None
    return code, out or "", time.monotonic() - t0


def run_section(name: str, args: Any, deadline: float, out_dir: Path) -> dict[str, Any]:
    """Run one section in its box; its result, or why it failed or was skipped."""
    if name == "env":
        got: dict[str, Any] = {}
        section(got, "env", env_info)
        return got["env"]
    left = deadline - time.monotonic()
    if left < 20:
        return {"ok": False, "skipped": f"out of time ({left:.0f} s left): rerun with --resume"}
    box = min(args.boxes[name], left - 5)
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        code, out, seconds = run_process(command(name, args, out_dir, result_path), box)
        with open(out_dir / "sections.log", "a") as log:
            log.write(f"\n##### {name} (exit {code}, {seconds:.1f} s)\n{out[-LOG_TAIL:]}")
        res = read_result(name, code, out, result_path, out_dir)
    res["seconds"] = round(seconds, 1)
    if code is None:
        res |= {"ok": False, "error": f"killed at its {box:.0f} s box"}
    elif code and res.get("ok", True):
        res |= {"ok": False, "error": f"exit status {code}: {out.strip()[-300:]}"}
    return res


def read_result(name: str, code: int | None, out: str, path: str, out_dir: Path) -> dict:
    """A section's figures from its result file, JSON or pytest summary."""
    if name == "pytest":
        lines = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|skipped)", ln)]
        failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        return {
            "ok": code == 0,
            "summary": lines[-1].strip("= ") if lines else "",
            "failed": failed,
        }
    if name == "step":
        p = out_dir / "bench_layer_cuda.json"
        got = json.loads(p.read_text()) if p.exists() else {}  # a failed R: the rest
        return {"ok": code == 0 and bool(got), "acceptance": got.get("acceptance", {}),
                "rows": len(got.get("rows", []))}  # fmt: skip
    if not os.path.exists(path):
        return {"ok": False, "error": "no result written"}
    subs = json.loads(Path(path).read_text())
    ok = subs.get("ok", all(v.get("ok") for v in subs.values() if isinstance(v, dict)))
    return {**subs, "ok": bool(ok) and code == 0}


# ---- env, table, main -------------------------------------------------------------------------
def env_info() -> dict[str, Any]:
    """Versions, the device and what is importable (no CUDA context is created)."""
    import importlib.metadata as md
    import importlib.util

    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    for dist in ("triton", "cuda-bindings", "nvshmem4py-cu13", "nvshmem4py-cu12"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    info["nvshmem_importable"] = importlib.util.find_spec("nvshmem") is not None
    if info["cuda"]:
        info["device"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
        info["devices"] = torch.cuda.device_count()
    from moonplan.plan import cuda_backend

    info["cuda_planner"] = cuda_backend.available()[1] or "available"
    return info


def headline(name: str, r: dict[str, Any]) -> str:
    """One line of a section's figures for the table."""
    if "skipped" in r:
        return str(r["skipped"])
    if "error" in r and name not in ("heaps",):
        return str(r["error"])[:90]
    if name == "env":
        return f"{r.get('device', 'no CUDA')}; torch {r.get('torch')}; triton {r.get('triton')}"
    if name == "nvshmem_install":
        return f"nvshmem4py: {r.get('from', '')}"
    if name == "heaps":
        parts = [f"{k}: {'ok' if v.get('ok') else v.get('error', v.get('skipped', '?'))}"
                 for k, v in r.items() if isinstance(v, dict)]  # fmt: skip
        return "; ".join(parts)[:120]
    if name == "pytest":
        return f"{r.get('summary')}" + (f"; {len(r['failed'])} failed" if r.get("failed") else "")
    if name == "step":
        a = r.get("acceptance", {})
        return (f"R={a.get('R')}: auto/static uniform worst {a.get('uniform_worst', 0):.3f} "
                f"(bar 1.02), lognormal >=1024 worst {a.get('lognormal_from_1024_worst', 0):.3f}"
                " (bar < 1)")  # fmt: skip
    return _figures_line(name, r)


def _figures_line(name: str, r: dict[str, Any]) -> str:
    if name == "runtime":
        k, t, e = r.get("kernels", {}), r.get("token_rows", {}), r.get("experts", {})
        best = max((x["scatter_share"] for x in k.get("tiles", [])), default=0)
        return (f"scatter {k.get('scatter_share', 0):.2f} (best tile {best:.2f}), gather "
                f"{k.get('gather_share', 0):.2f}, expand {t.get('expand_share', 0):.2f}, reduce "
                f"{t.get('reduce_share', 0):.2f} of a copy; experts {e.get('share_of_mm', 0):.2f}"
                f" (triton {e.get('triton_best_share', 0):.2f}) of mm")  # fmt: skip
    if name == "planner":
        rows = {(tuple(x["shape"]), x["policy"]): x for x in r.get("api", {}).get("rows", [])}
        exact = rows.get(((8, 896, 8192, 8), "exact"), {})
        timing = r.get("timing", {}).get("rows", [{}])
        auto = {(x["shape"][0], x["path"]): x for x in r.get("auto", {}).get("rows", [])}

        def us(R: int, key: str) -> str:
            return "/".join(str(auto.get((R, p), {}).get(key, "-")) for p in ("full", "exit"))

        return (
            f"kernel graph {timing[0].get('cuda_us', '-')} us at (8, 896, 8192, 8) "
            f"(target 25); plan(exact) eager {exact.get('eager_us', '-')} us; auto full/exit "
            f"graph {us(8, 'graph_us')} us at EP 8 (25), {us(64, 'graph_us')} at EP 64 (60), "
            f"host {us(8, 'host_us')} us at EP 8 (80); decision table/all tables/whole "
            "(host) "
            + ", ".join(_decision_ms(x) for x in r.get("decision", {}).get("rows", []))
            + " ms (olmoe EP 8 at 256 and 16 tokens, V3 EP 8, V3 EP 64)"
        )
    return ""


def _decision_ms(row: dict[str, Any]) -> str:
    """One decision row's one-table, all-tables and whole-decision milliseconds (and the
    same decision on the host)."""
    return (f"{row.get('table_ms', 0):.1f}/{row.get('tables_ms', 0):.1f}/"
            f"{row.get('decision_ms', 0):.1f} ({row.get('decision_host_ms', 0):.0f})")  # fmt: skip


def print_table(results: dict[str, Any]) -> None:
    from moonplan.tables import render

    rows = [[name, "ok" if r.get("ok") else ("skipped" if "skipped" in r else "FAILED"),
             str(r.get("seconds", "-")), headline(name, r)]
            for name, r in results.items() if isinstance(r, dict)]  # fmt: skip
    print("\n" + render(["section", "status", "s", "figures"], rows, title="== gpu_check"))
    print(
        "targets: row kernels >= 0.70 of a copy; experts >= 0.70 of torch.mm; planner kernel"
        " <= 25 us; plan(auto) graph <= 25 us (EP 8) / 60 us (EP 64), host <= 80 us (EP 8);"
        " auto <= 1.02x static (uniform), < 1x (lognormal, >= 1024 tokens)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.section:
        return run_child(args.section, args.section_out, args.cpu_smoke)
    out_dir = Path(os.environ.get("OUT", "gpu_check_out")).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.resume:
        (out_dir / "sections.log").write_text("")
    results: dict[str, Any] = {}
    if not args.cpu_smoke:
        results["nvshmem_install"] = _install_nvshmem()
    state = _load(args.state) if args.resume else {}
    deadline = time.monotonic() + args.budget_s
    for name in [s for s in args.sections.split(",") if s]:
        if state.get(name, {}).get("ok"):
            results[name] = {**state[name], "resumed": True}
            continue
        results[name] = run_section(name, args, deadline, out_dir)
        if name == "env" and not results["env"].get("cuda") and not args.cpu_smoke:
            break  # nothing else can run
        _save(args.state, {**state, **results})
        _save(str(out_dir / "gpu_check.json"), results)
    _save(str(out_dir / "gpu_check.json"), results)
    print(f"wrote {out_dir / 'gpu_check.json'}")
    print_table(results)
    if not results.get("env", {}).get("cuda") and not args.cpu_smoke:
        print("gpu_check: no CUDA device (--cpu-smoke checks the script on CPU)")
        return 2
    sections = [r for name, r in results.items() if name != "nvshmem_install"]
    return 0 if all(r.get("ok") for r in sections) else 1


def _install_nvshmem() -> dict[str, Any]:
    """The carried nvshmem4py wheel, installed for every section's process (never fatal)."""
    import _gpu_heaps

    try:
        return _gpu_heaps.install_nvshmem()
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}


def _load(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text()) if os.path.exists(path) else {}


def _save(path: str, data: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
