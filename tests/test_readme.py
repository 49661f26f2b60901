"""Every ``python`` example and shell command of README.md runs as written and says what
it claims.

The examples are extracted from README.md at test time, so they cannot drift. An example
that starts a process group (``dist.init_process_group``) runs on as many ranks as its
``torchrun --nproc-per-node N`` comment says, under :func:`moonplan.testing.dist.run_ranks`
(which has already initialised the group: the example's own call is then a no-op that
checks the backend). Examples needing an optional package skip without it, naming it.

Shell commands (``bash`` blocks) run in order in a fresh folder, ``./bin/`` pointing at
this checkout's scripts: every one but ``./bin/test`` (the suite itself). Those that
import torch or start ranks are marked ``slow`` (about a minute together); ``cost`` is not.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from moonplan.testing.dist import run_ranks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
SHELL = [
    line.split("  #")[0].split(" # ")[0].strip()
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    for line in block.splitlines()
    if line.strip() and not line.lstrip().startswith("#")
]
NOT_RUN = {"./bin/test": "the test suite itself"}


def _block(marker: str) -> str:
    found = [b for b in BLOCKS if marker in b]
    assert len(found) == 1, f"expected one README python example containing {marker!r}"
    return found[0]


def _ranks(code: str) -> int:
    m = re.search(r"--nproc-per-node (\d+)", code)
    assert m, "a distributed README example must say how to launch it (torchrun --nproc-per-node N)"
    return int(m.group(1))


def _exec_on_rank(rank: int, world: int, code: str, workdir: str, check: Any) -> Any:
    import torch.distributed as dist

    def already_up(backend: str | None = None, *args: Any, **kwargs: Any) -> None:
        assert backend == dist.get_backend(), f"example asks for {backend!r}"

    dist.init_process_group = already_up  # type: ignore[assignment]
    os.chdir(workdir)
    scope: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(code, "README.md", "exec"), scope)
    return check(rank, world, scope)


def test_every_python_example_is_covered() -> None:
    markers = ("moonplan.plan(counts)", "MoonMoE(", "wrap_model(", "@given(")
    assert len(BLOCKS) == len(markers), "a new README python example needs a test here"
    for m in markers:
        _block(m)


def test_planner_example() -> None:
    scope: dict[str, Any] = {}
    exec(compile(_block("moonplan.plan(counts)"), "README.md", "exec"), scope)
    assert scope["plan"].alloc.sum(0).tolist() == [8, 8, 8, 8]
    assert scope["plan"].summary()["copies"] == 2
    assert scope["nxt"].new_copies() == 0
    route = scope["route"]  # rank 0's records, routed: every one to a rank of the plan
    assert route.dest_rank.shape == (16, 2) and route.send_counts.sum() == 32
    assert route.send_counts.tolist() == scope["plan"].alloc[:, :].sum(0).tolist()


def _check_layer(rank: int, world: int, scope: dict) -> dict:
    x, y, layer = scope["x"], scope["y"], scope["layer"]
    assert y.shape == x.shape and bool(torch.isfinite(y).all())
    grads = [p.grad for p in layer.parameters()]
    assert all(g is not None for g in grads)
    return {"copies": layer.last_stats.copies}


@pytest.mark.distributed
def test_layer_example_runs_on_its_ranks(tmp_path: Path) -> None:
    code = _block("MoonMoE(")
    got = run_ranks(_exec_on_rank, _ranks(code), code, str(tmp_path), _check_layer, timeout=90)
    assert len({g["copies"] for g in got}) == 1  # every rank saw the same plan


def _check_wrap_model(rank: int, world: int, scope: dict) -> dict:
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)  # the example's seed: the unwrapped model with the same weights
    ref = MixtralForCausalLM(scope["config"])
    ids = scope["ids"]
    want = ref(input_ids=ids, labels=ids)
    got = scope["out"]
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    return {"loss": float(got.loss)}


@pytest.mark.distributed
def test_wrap_model_example_runs_on_its_ranks(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the example needs the 'transformers' extra")
    code = _block("wrap_model(")
    world = _ranks(code)
    run_ranks(_exec_on_rank, world, code, str(tmp_path), _check_wrap_model, timeout=120)
    want = ["manifest.json"] + [f"rank-{r:05d}-of-{world:05d}.pt" for r in range(world)]
    assert sorted(os.listdir(tmp_path / "ckpt")) == want  # the sharded checkpoint it saves


def test_property_test_example() -> None:
    pytest.importorskip("hypothesis", reason="the example needs the 'test' extra")
    scope: dict[str, Any] = {"__name__": "readme"}
    exec(compile(_block("@given("), "README.md", "exec"), scope)
    tests = [f for name, f in scope.items() if name.startswith("test_") and callable(f)]
    assert tests, "the property-test example defines no test_* function"
    for test in tests:  # as pytest would run them (the example may also call them itself)
        test()


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command`` as README.md writes it, with ``./bin/`` this checkout's scripts."""
    line = command.replace("./bin/", f"{ROOT}/bin/")
    done = subprocess.run(
        ["bash", "-c", line], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


def test_every_shell_command_is_run_or_excused() -> None:
    assert SHELL, "README.md has no bash block"
    assert all(c.startswith(("./bin/", "bash ")) for c in SHELL), SHELL
    assert {c for c in SHELL if c in NOT_RUN} == set(NOT_RUN)


def test_cost_command(tmp_path: Path) -> None:
    (command,) = [c for c in SHELL if c.startswith("./bin/moonplan cost")]
    assert "dispatch/combine bytes per rank" in _run(command, tmp_path).stdout


@pytest.mark.slow  # each command imports torch; demo and torchrun start 4 ranks twice
def test_shell_commands_run_in_order(tmp_path: Path) -> None:
    """Every command but ``cost`` (above) and ``./bin/test``, in README order: the plan
    commands read the counts file an earlier one saves."""
    for command in SHELL:
        if command in NOT_RUN or command.startswith("./bin/moonplan cost"):
            continue
        out = _run(command, tmp_path).stdout
        if "--save counts.npy" in command:
            assert "wrote counts.npy" in out and (tmp_path / "counts.npy").exists()
        if "--json" in command:
            assert "alloc" in json.loads(out)["plan"]
        if command.endswith("demo") or " demo " in command:
            assert "matches the single-process layer" in out
