"""The prepared GPU scripts stay runnable: their CPU smoke mode runs every section, a
section that fails or runs out of time fails alone, and a rerun resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _smoke(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1"}
    state = str(tmp_path / "state.json")
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu-smoke", "--state", state,
         *extra],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    path = tmp_path / "out" / "gpu_check.json"
    return r, json.loads(path.read_text()) if path.exists() else {}


def test_gpu_check_cpu_smoke_runs_every_section(tmp_path: Path) -> None:
    """Every section's code runs on CPU; the table comes last; --resume reruns nothing."""
    pytest.importorskip("triton", reason="the row kernels run interpreted by Triton")
    r, got = _smoke(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert list(got) == ["env", "heaps", "pytest", "step", "runtime", "planner"]
    assert all(v["ok"] for v in got.values()), got
    assert got["heaps"]["layers"]["same_y_dx_dgate_up"] == [True, True, True]
    assert got["heaps"]["ipc_2"]["ok"] and got["heaps"]["ipc_1"]["backend"] == "ipc"
    k, t = got["runtime"]["kernels"], got["runtime"]["token_rows"]
    assert k["same_scatter"] and k["same_gather"] and t["same_expand"] and t["same_reduce"]
    assert len(k["tiles"]) >= 3 and got["runtime"]["experts"]["triton"]
    assert got["runtime"]["layer"]["max_rel_err"] < 1e-5
    assert "skipped" in got["pytest"]["summary"] and got["step"]["rows"] > 0
    assert {row["policy"] for row in got["planner"]["api"]["rows"]} >= {"exact", "auto"}
    assert r.stdout.rstrip().splitlines()[-1].startswith("targets:")
    assert (tmp_path / "out" / "sections.log").read_text().count("\n##### ") == 5
    again, got2 = _smoke(tmp_path, "--resume")
    assert again.returncode == 0 and all(v.get("resumed") for v in got2.values()), got2


def test_gpu_check_a_failing_section_fails_alone(tmp_path: Path) -> None:
    """A section killed at its box is reported, the next one still runs; with no time left
    the rest are skipped, and --resume runs only what is not ok."""
    r, got = _smoke(tmp_path, "--sections", "env,heaps,planner", "--box", "heaps=0.5")
    assert r.returncode == 1, r.stdout[-2000:]
    assert got["env"]["ok"] and got["planner"]["ok"]
    assert not got["heaps"]["ok"] and "killed at its 0 s box" in got["heaps"]["error"]
    r, got = _smoke(tmp_path, "--sections", "env,heaps,planner", "--resume", "--budget-s", "1")
    assert r.returncode == 1 and got["env"]["resumed"] and got["planner"]["resumed"]
    assert "out of time" in got["heaps"]["skipped"]


@pytest.mark.slow  # spawns a rank and builds three layers
def test_gpu_profile_cpu_smoke_times_every_mode(tmp_path: Path) -> None:
    """``bench/gpu_profile.py``: both parts run on CPU; the layer part reports every balance
    mode with its host profile, the choice part its shapes (no kernels on CPU)."""
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "bench" / "gpu_profile.py")
    r = subprocess.run([sys.executable, script, "--cpu-smoke"], env=env, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = json.loads((tmp_path / "gpu_profile.json").read_text())
    assert [row["variant"] for row in got["layer"]] == ["static", "exact", "auto"]
    assert all(row["wall_ms"] >= row["host_ms"] > 0 for row in got["layer"])
    assert {row["path"] for row in got["choice"]} == {"full", "exit"}
    pstats_text = (tmp_path / "layer_pstats.txt").read_text()
    assert pstats_text.count("by own time") == 3 and "run_sections" in pstats_text


def test_gpu_check_says_no_device(tmp_path: Path) -> None:
    script = ROOT / "bench" / "gpu_check.py"
    r = subprocess.run(
        [sys.executable, str(script), "--state", str(tmp_path / "state.json")],
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
        "gpu_profile.py",
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
