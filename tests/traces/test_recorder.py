"""Routing traces of a wrapped model: per layer ``[T, R, E]`` files that the CLI and simulator read.

Each rank checks its own row of every recorded step against the unwrapped model's router
(top-k ids counted per expert); the parent reads the files back.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from moonplan.cli.main import main as cli_main
from moonplan.simulate.workload import recorded_counts
from moonplan.testing.dist import run_ranks
from moonplan.traces.recorder import TraceRecorder, load_trace
from tests.adapters.tiny import batch, make_model

pytestmark = pytest.mark.distributed

SIZES, STEPS, E = [5, 8], 3, 6


def _rank(rank: int, world: int, directory: str) -> list:
    from moonplan.adapters import wrap_model

    model = make_model("Mixtral")
    ref = copy.deepcopy(model)
    seen: dict[str, list] = {}
    for name, m in ref.named_modules():
        if name.endswith("mlp.gate"):  # the original router: counts of its top-k ids
            seen[name] = []
            m.register_forward_hook(
                lambda mod, a, out, n=name: seen[n].append(
                    torch.bincount(out[2].flatten(), minlength=E)
                )
            )
    wrap_model(model)
    with TraceRecorder(model) as rec:
        for step in range(STEPS):
            ids = batch(rank, SIZES, seed=step)
            model(input_ids=ids)
            ref(input_ids=ids)
    model(input_ids=batch(rank, SIZES, seed=0))  # after close: not recorded
    for name, want in seen.items():
        got_TRE = rec.counts(name.removesuffix("gate") + "experts")
        assert got_TRE.shape == (STEPS, world, E)
        assert torch.equal(got_TRE[:, rank], torch.stack(want))
    index = rec.save(directory)
    return [rank, index is not None]


def test_recorded_trace_files(tmp_path: Path) -> None:
    got = run_ranks(_rank, 2, str(tmp_path), timeout=60)
    assert got == [[0, True], [1, False]]  # rank 0 writes
    index = json.loads((tmp_path / "layers.json").read_text())
    assert [layer["file"] for layer in index["layers"]] == ["layer-000.npy", "layer-001.npy"]
    traces = load_trace(tmp_path)
    assert list(traces) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for counts_TRE in traces.values():
        assert counts_TRE.shape == (STEPS, 2, E)
        assert counts_TRE.sum(2).tolist() == [[2 * s * 2 for s in SIZES]] * STEPS  # 2 rows, K=2
    assert recorded_counts(tmp_path / "layer-001.npy").shape == (STEPS, 2, E)
    assert cli_main(["plan", str(tmp_path / "layer-000.npy"), "--step", "2", "--json"]) == 0


def _moe_rank(rank: int, world: int, _: None) -> dict:
    """A ``MoonMoE`` recorded for two training steps (forward and backward), then one
    step after the recorder closed: its counts and the router's own."""
    from moonplan import MoonMoE

    torch.manual_seed(0)  # the same weights on every rank
    layer = MoonMoE(8, 12, E, 2, balance="exact")
    x_SH = torch.randn(SIZES[rank], 8, generator=torch.Generator().manual_seed(rank))
    ids_SK = torch.topk(layer.router(x_SH).detach(), 2, dim=-1).indices
    mine_E = torch.bincount(ids_SK.flatten(), minlength=E)
    with TraceRecorder(layer) as rec:
        for _ in range(2):
            layer(x_SH).sum().backward()  # the backward replays the plan: no new step
    layer(x_SH)
    return {"counts": rec.counts(), "mine": mine_E, "names": rec.names}


def test_a_moonmoe_is_recorded_once_a_step_while_the_recorder_is_open() -> None:
    got = run_ranks(_moe_rank, 2, None, timeout=120)
    counts = got[0]["counts"]
    assert got[0]["names"] == ["experts"]
    assert counts.shape == (2, 2, E)
    assert torch.equal(counts, got[1]["counts"])
    for r, g in enumerate(got):
        assert torch.equal(counts[0, r], g["mine"]) and torch.equal(counts[1, r], g["mine"])
