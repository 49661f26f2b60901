"""Every ``python`` example of README.md runs as written and says what it claims.

The examples are extracted from README.md at test time, so they cannot drift. An example
that starts a process group (``dist.init_process_group``) runs on as many ranks as its
``torchrun --nproc-per-node N`` comment says, under :func:`moonplan.testing.dist.run_ranks`
(which has already initialised the group: the example's own call is then a no-op that
checks the backend). Examples needing an optional package skip without it, naming it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from moonplan.testing.dist import run_ranks

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


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
