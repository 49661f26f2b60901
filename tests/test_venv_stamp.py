"""``bin/_venv.sh``: the stamp keeps every installed extra, so alternating bin/test and
bin/moonplan installs nothing; a changed pyproject.toml reinstalls.

Runs the real script under bash with a stub ``python`` in a stub venv that only logs
its ``pip install`` calls (no network, nothing installed).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    not (shutil.which("bash") and shutil.which("sha256sum")), reason="needs bash and sha256sum"
)


def _setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    root, venv, log = tmp_path / "root", tmp_path / "venv", tmp_path / "pip.log"
    (root / "bin").mkdir(parents=True)
    (venv / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "bin" / "_venv.sh", root / "bin" / "_venv.sh")
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    stub = venv / "bin" / "python"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    stub.chmod(0o755)
    return root, venv, log


def _run(root: Path, venv: Path, *requests: str) -> None:
    calls = "; ".join(f'moonplan_venv "{r}"' for r in requests)
    script = f'set -euo pipefail; . "{root}/bin/_venv.sh"; {calls}'
    subprocess.run(
        ["bash", "-c", script],
        check=True,
        env={"MOONPLAN_VENV": str(venv), "PATH": "/usr/bin:/bin"},
        capture_output=True,
    )


def _installs(log: Path) -> list[str]:
    return [line.split()[-1] for line in log.read_text().splitlines()] if log.exists() else []


def test_alternating_requests_install_once_each(tmp_path: Path) -> None:
    root, venv, log = _setup(tmp_path)
    _run(root, venv, "", "test", "", "test", "")
    assert _installs(log) == [str(root), f"{root}[test]"]


def test_installed_extras_satisfy_smaller_requests(tmp_path: Path) -> None:
    root, venv, log = _setup(tmp_path)
    _run(root, venv, "test,torchtitan", "test", "torchtitan", "")
    assert _installs(log) == [f"{root}[test,torchtitan]"]


def test_changed_pyproject_reinstalls(tmp_path: Path) -> None:
    root, venv, log = _setup(tmp_path)
    _run(root, venv, "test", "")
    with (root / "pyproject.toml").open("a") as f:
        f.write("# changed\n")
    _run(root, venv, "", "test", "")
    assert _installs(log) == [f"{root}[test]", str(root), f"{root}[test]"]
