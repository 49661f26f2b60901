"""The moonplan command: demo, plan and cost subcommands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moonplan.cli.main import main


def test_plan_generated_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--ranks", "4", "--experts", "16", "--tokens", "256", "--topk", "2"]) == 0
    out = capsys.readouterr().out
    assert "static EP" in out and "MoonEP greedy" in out
    assert out.count("\n") >= 4 + 2


def test_plan_json_from_npy_and_json_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    c = np.array([[9, 1, 2, 0, 3, 5, 4, 8], [0] * 8, [0] * 8, [0] * 8], dtype=np.int64)
    np.save(tmp_path / "c.npy", c)
    (tmp_path / "c.json").write_text(json.dumps(c.tolist()))
    for name in ("c.npy", "c.json"):
        assert main(["plan", str(tmp_path / name), "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        assert s["planned_load"] == [8, 8, 8, 8]
        assert s["static_load"] == [10, 2, 8, 12]
        assert s["copies"] == 2 and s["moonep_greedy_copies"] == 2
        assert s["copies_lower_bound"] == 1


def test_plan_prints_slots_flows_and_alloc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    c = np.array([[9, 1, 2, 0, 3, 5, 4, 8], [0] * 8, [0] * 8, [0] * 8], dtype=np.int64)
    np.save(tmp_path / "c.npy", c)
    assert main(["plan", str(tmp_path / "c.npy")]) == 0
    out = capsys.readouterr().out
    assert "group flows" in out and "donor" in out and "alloc[e, r]" in out
    assert main(["plan", str(tmp_path / "c.npy"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    plan = s["plan"]
    alloc = np.array(plan["alloc"])
    assert alloc.shape == (8, 4) and alloc.sum(0).tolist() == [8, 8, 8, 8]
    assert (alloc.sum(1) == c.sum(0)).all()
    for key in ("slot_expert", "slot_new", "flow", "home", "row_expert", "row_offset"):
        assert key in plan
    split = [e for e in range(8) if (alloc[e] > 0).sum() > 1]
    assert split and f"alloc[e, r] of the {len(split)} experts" in out


def test_plan_step_must_match_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = np.ones((3, 2, 4), dtype=np.int64)
    np.save(tmp_path / "t.npy", trace)
    np.save(tmp_path / "c.npy", trace[0])
    assert main(["plan", str(tmp_path / "t.npy")]) == 2  # which step? no silent step 0
    assert "pass --step (0..2)" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "t.npy"), "--step", "2"]) == 0
    capsys.readouterr()
    assert main(["plan", str(tmp_path / "c.npy"), "--step", "1"]) == 2  # not silently ignored
    assert "--step applies to [T, R, E]" in capsys.readouterr().err
    assert main(["plan", "--step", "1"]) == 2
    assert "generated counts" in capsys.readouterr().err


def test_plan_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.json").write_text("[[1, -1]]")
    assert main(["plan", str(tmp_path / "bad.json")]) == 2
    assert "non-negative" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "missing.npy")]) == 2


def test_cost_prints_seed_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "--model", "mixtral-8x7b", "--ep", "8", "--tokens", "512"]) == 0
    out = capsys.readouterr().out
    for figure in ("7.0 MiB", "14.0 MiB", "448.0 MiB", "10.50", "2.75", "13.25"):
        assert figure in out


@pytest.mark.distributed
def test_demo_runs_ranks_and_checks_against_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "demo",
        "--ranks",
        "3",
        "--steps",
        "2",
        "--tokens",
        "32",
        "--hidden",
        "16",
        "--ffn",
        "24",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "matches the single-process layer within rtol=1e-05, atol=1e-06" in out
    assert out.count("\n") >= 4


def test_console_script_entry_point() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "moonplan.cli", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0 and "demo" in r.stdout and "cost" in r.stdout


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import moonplan

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"moonplan {moonplan.__version__}"


@pytest.mark.parametrize("command", ["demo", "plan", "profile", "cost", "simulate"])
def test_ep_everywhere_with_ranks_as_alias(command: str) -> None:
    from moonplan.cli.main import build_parser

    parser = build_parser()
    value = "4" if command != "simulate" else "4,8"
    a = parser.parse_args([command, "--ep", value])
    b = parser.parse_args([command, "--ranks", value])
    dest = "ep" if command in ("cost", "simulate") else "ranks"
    assert getattr(a, dest) == getattr(b, dest) and getattr(a, dest) in (4, [4, 8])
    assert "--ep" in parser._subparsers._group_actions[0].choices[command].format_help()


def test_presets_are_case_insensitive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "--model", "Mixtral-8x7B", "--ep", "8"]) == 0
    assert "mixtral-8x7b" in capsys.readouterr().out
    argv = ["simulate", "--model", "Mixtral-8x7B", "--hardware", "H200-Multinode", "--ep", "2",
            "--sigma", "1", "--tokens", "32", "--steps", "1", "--warmup", "1", "--no-progress",
            "--policies", "static-linear"]  # fmt: skip
    assert main(argv) == 0


def test_launched_size_must_match_ep(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")  # as torchrun sets it: the launched job has 3 ranks
    assert main(["demo", "--ep", "2"]) == 2
    assert "differs from the launched job's 3 ranks" in capsys.readouterr().err
    assert main(["profile", "--ep", "2"]) == 2


@pytest.mark.slow  # torchrun starts fresh interpreters (6-13 s each)
@pytest.mark.distributed
@pytest.mark.parametrize("command", ["demo", "profile"])
def test_runs_under_torchrun(command: str, tmp_path: Path) -> None:
    small = ["--steps", "2", "--tokens", "32", "--hidden", "16", "--ffn", "24"]
    extra = ["--out", str(tmp_path / "prof"), "--warmup", "1"] if command == "profile" else []
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "moonplan.cli", command, *small, *extra],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"moonplan {command}: 2 ranks (gloo)" in r.stdout  # the launched group, printed once
    assert r.stdout.count(f"moonplan {command}:") == 1
    if command == "demo":
        assert "matches the single-process layer" in r.stdout
    else:
        assert (tmp_path / "prof" / "profile.json").exists()


BAD_ARGUMENTS = [
    ["demo", "--ranks", "0"],
    ["demo", "--ranks", "-1"],
    ["demo", "--tokens", "-1"],
    ["demo", "--topk", "0"],
    ["demo", "--topk", "99"],
    ["demo", "--experts", "0"],
    ["demo", "--hidden", "0"],
    ["demo", "--ffn", "0"],
    ["demo", "--steps", "0"],
    ["demo", "--sigma", "nan"],
    ["demo", "--timeout", "0"],
    ["demo", "--seed", "x"],
    ["plan", "--backend", "cuda"],  # only where no CUDA device is visible (checked below)
    ["plan", "--backend", "gpu"],
    ["plan", "--ranks", "0"],
    ["plan", "--topk", "99"],
    ["plan", "--slots", "-1"],
    ["plan", "--slots", "1000000000"],
    ["plan", "--align", "0"],
    ["plan", "--align", str(2**62)],
    ["plan", "--step", "-1"],
    ["cost", "--tokens", "-1"],
    ["cost", "--model", "nope"],
    ["simulate", "--rho", "2"],
    ["simulate", "--ep", "0"],
    ["simulate", "--steps", "0"],
    ["simulate", "--eplb-period", "0"],
    ["simulate", "--tokens-grid", "-1", "--break-even"],
    ["profile", "--experts", "0"],
    ["profile", "--topk", "99"],
    ["profile", "--tokens", "-1"],
    ["profile", "--timeout", "-1"],
    ["profile", "--ep", "0"],
    ["profile", "--steps", "0"],
    ["profile", "--layers", "0"],
    ["profile", "--warmup", "-1"],
    ["nope"],
    [],
]


def _status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return int(exc.code or 0)


@pytest.mark.parametrize("argv", BAD_ARGUMENTS, ids=" ".join)
def test_bad_arguments_exit_2_with_one_line(argv, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if argv[:3] == ["plan", "--backend", "cuda"] and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: --backend cuda is valid here")
    assert _status(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("moonplan") and ": error: " in lines[0]
    assert "Traceback" not in captured.err + captured.out


def test_overflowing_counts_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "big.npy", np.full((4, 8), 2**62, dtype=np.int64))
    assert main(["plan", str(tmp_path / "big.npy")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "int64 limit" in err
