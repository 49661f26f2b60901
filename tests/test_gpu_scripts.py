"""The prepared GPU scripts stay runnable: their CPU smoke mode runs every section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a fresh interpreter runs the whole check on CPU (3-15 s)
def test_runtime_check_cpu_smoke(tmp_path: Path) -> None:
    pytest.importorskip("triton", reason="the row kernels run interpreted by Triton")
    env = {**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1"}
    script = ROOT / "bench" / "gpu_runtime_check.py"
    r = subprocess.run(
        [sys.executable, str(script), "--cpu-smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = json.loads((tmp_path / "gpu_runtime_check.json").read_text())
    assert got["kernels"]["same_scatter"] and got["kernels"]["same_gather"]
    assert got["layer"]["max_rel_err"] < 1e-5 and got["layer"]["grads_finite"]


@pytest.mark.slow  # a fresh interpreter runs the planner check (1.8-10 s)
def test_planner_check_says_no_device(tmp_path: Path) -> None:
    script = ROOT / "bench" / "gpu_check.py"
    r = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode == 0:
        pytest.skip("a CUDA device is present: the real check ran")
    assert r.returncode == 2 and (tmp_path / "gpu_check.json").exists()


@pytest.mark.slow  # a fresh interpreter per script imports torch (1.6-7 s each)
@pytest.mark.parametrize(
    "name",
    [
        "gpu_check.py",
        "gpu_runtime_check.py",
        "bench_plan.py",
        "bench_experts.py",
        "bench_layer.py",
        "bench_wrap.py",
        "bench_simulate.py",
        "bench_two_stage.py",
    ],
)
def test_help_runs_nothing(name: str, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / name), "--help"],
        env={**os.environ, "OUT": str(tmp_path)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-2000:]
    assert not any(tmp_path.iterdir()), "--help wrote files: it ran the script"
