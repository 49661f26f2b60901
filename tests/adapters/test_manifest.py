"""Verified checkpoints: fault injection on saved shards, and DCP across EP sizes.

Legend: R ranks that saved, R' ranks that load, E experts, H hidden, F expert FFN size.

A ``MoonMoE`` saved at 2 ranks, then damaged in the ways files break: flipped bytes,
cut short, emptied, grown, a shard of another checkpoint of the same world size swapped
in, a shard deleted, the manifest deleted or garbled. Loading at 3 ranks must raise the
same error on every rank naming the file and the problem; ``consolidate`` (one process)
likewise; the intact checkpoint loads bit for bit. Then the same model through
``torch.distributed.checkpoint`` with per-expert keys, saved at 2 ranks, loaded at 3.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from moonplan import checkpoint
from moonplan.adapters.manifest import MANIFEST, CheckpointError, check_file, read_manifest
from moonplan.testing.dist import run_ranks

pytestmark = pytest.mark.distributed

H, F, E, K = 16, 24, 6, 2
TIMEOUT = 60.0


def _model(seed: int):
    """A MoonMoE on the current group with weights drawn from ``seed`` (every rank alike)."""
    from moonplan import MoonMoE

    layer = MoonMoE(H, F, E, K, balance="exact")
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(E, H, generator=g), torch.randn(E, 2 * F, H, generator=g)]
    layer.load_dense(*full, torch.randn(E, H, F, generator=g))
    return layer


def _out(layer, rank: int) -> torch.Tensor:
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(100 + rank))
    with torch.no_grad():
        return layer(x)


def _save_two(rank: int, world: int, first: str, second: str) -> None:
    checkpoint.save_sharded(_model(0), first)
    checkpoint.save_sharded(_model(1), second)


def _load_each(rank: int, world: int, dirs: list[str]) -> list[tuple[str, str, bool]]:
    """Load each directory into a model of other weights: (error type, message, whether
    the outputs then equal those of the saved weights)."""
    want = _out(_model(0), rank)
    out = []
    for d in dirs:
        layer = _model(7)
        try:
            checkpoint.load_sharded(layer, d)
            out.append(("", "", torch.equal(_out(layer, rank), want)))
        except Exception as exc:
            out.append((type(exc).__name__, str(exc), False))
    return out


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
    path.write_bytes(bytes(data))


FAULTS = {  # name -> (damage the copy, words every error must hold)
    "intact": (lambda d, other: None, []),
    "flipped bytes": (
        lambda d, other: _flip(d / "rank-00001-of-00002.pt"),
        ["rank-00001", "corrupt: crc32"],
    ),
    "truncated": (
        lambda d, other: (d / "rank-00000-of-00002.pt").write_bytes(
            (d / "rank-00000-of-00002.pt").read_bytes()[:1000]
        ),
        ["rank-00000-of-00002.pt: truncated: 1000 bytes, the manifest lists"],
    ),
    "empty": (
        lambda d, other: (d / "rank-00001-of-00002.pt").write_bytes(b""),
        ["rank-00001-of-00002.pt: truncated: 0 bytes"],
    ),
    "grown": (
        lambda d, other: _append(d / "rank-00001-of-00002.pt", b"x" * 10),
        ["rank-00001-of-00002.pt: longer: ", "bytes, the manifest lists"],
    ),
    "swapped": (
        lambda d, other: shutil.copy(other / "rank-00001-of-00002.pt", d),
        ["rank-00001-of-00002.pt: from another checkpoint (id "],
    ),
    "deleted": (
        lambda d, other: (d / "rank-00000-of-00002.pt").unlink(),
        ["rank-00000-of-00002.pt: missing"],
    ),
    "no manifest": (
        lambda d, other: (d / MANIFEST).unlink(),
        ["manifest.json is missing", "verify=False"],
    ),
    "bad manifest": (
        lambda d, other: (d / MANIFEST).write_text('{"format": "moonplan-manifest-v1"}'),
        ["is not a moonplan-manifest-v1 manifest (no 'files')"],
    ),
}


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    good, other = root / "good", root / "other"
    run_ranks(_save_two, 2, str(good), str(other), timeout=TIMEOUT)
    dirs = {}
    for name, (damage, _) in FAULTS.items():
        d = root / name.replace(" ", "-")
        shutil.copytree(good, d)
        damage(d, other)
        dirs[name] = d
    return dirs


def test_save_writes_a_manifest_that_lists_every_shard(damaged: dict[str, Path]) -> None:
    d = damaged["intact"]
    manifest = read_manifest(d)
    assert manifest.world_size == 2 and len(manifest.checkpoint_id) == 32
    assert sorted(manifest.files) == ["rank-00000-of-00002.pt", "rank-00001-of-00002.pt"]
    for name, listed in manifest.files.items():
        assert listed.nbytes == (d / name).stat().st_size
        assert check_file(d, name, listed, manifest.checkpoint_id) == ""
    assert not list(d.glob(".*partial"))  # no temporary file left behind
    other = read_manifest(damaged["swapped"].parent / "other")
    assert other.checkpoint_id != manifest.checkpoint_id  # every save has its own id


def test_damaged_checkpoints_raise_the_same_error_on_every_rank(damaged: dict[str, Path]) -> None:
    names = list(FAULTS)
    got = run_ranks(_load_each, 3, [str(damaged[n]) for n in names], timeout=TIMEOUT)
    for i, name in enumerate(names):
        errors = {(r[i][0], r[i][1]) for r in got}
        assert len(errors) == 1, (name, errors)  # the same type and message everywhere
        kind, message = errors.pop()
        if name == "intact":
            assert kind == "" and all(r[i][2] for r in got), "the intact checkpoint loads exactly"
            continue
        assert kind == "CheckpointError", (name, kind)
        for words in FAULTS[name][1]:
            assert words in message, (name, message)


@pytest.mark.parametrize("name", [n for n in FAULTS if n != "intact"])
def test_consolidate_names_the_file_and_the_problem(damaged: dict[str, Path], name: str) -> None:
    with pytest.raises(CheckpointError) as info:
        checkpoint.consolidate(damaged[name])
    for words in FAULTS[name][1]:
        assert words in str(info.value)


def test_unverified_loads_still_name_an_unreadable_file(damaged: dict[str, Path]) -> None:
    for name in ("truncated", "empty"):
        with pytest.raises(CheckpointError, match=r"rank-0000[01]-of-00002\.pt: cannot be read"):
            checkpoint.consolidate(damaged[name], verify=False)
    full = checkpoint.consolidate(damaged["no manifest"], verify=False)  # older checkpoints
    assert full["experts.gate_up_proj"].shape == (E, 2 * F, H)


# ---- torch.distributed.checkpoint (DCP) with per-expert keys ------------------------------
def _dcp_save(rank: int, world: int, d: str) -> list[str]:
    import torch.distributed.checkpoint as dcp

    layer = _model(0)
    state = layer.state_dict()  # per-expert keys: the default
    dcp.save(state, checkpoint_id=d)
    checkpoint.save_sharded(layer, d + "-own")  # moonplan's own format: unaffected by the mode
    return sorted(state)


def _dcp_load(rank: int, world: int, d: str) -> tuple[bool, list[str]]:
    import torch.distributed.checkpoint as dcp

    layer = _model(7)
    state = layer.state_dict()
    dcp.load(state, checkpoint_id=d)
    layer.load_state_dict(state)
    again = _model(7)
    checkpoint.load_sharded(again, d + "-own")
    want = _out(_model(0), rank)
    return torch.equal(_out(layer, rank), want) and torch.equal(_out(again, rank), want), sorted(
        state
    )


def test_dcp_saves_per_expert_keys_and_loads_at_another_ep_size(tmp_path: Path) -> None:
    d = str(tmp_path / "dcp")
    saved = run_ranks(_dcp_save, 2, d, timeout=TIMEOUT)
    experts = [f"experts.gate_up_proj.{e}" for e in range(E)]
    assert [k for k in saved[0] if k.startswith("experts.gate_up")] == experts[:3]
    assert [k for k in saved[1] if k.startswith("experts.gate_up")] == experts[3:]
    loaded = run_ranks(_dcp_load, 3, d, timeout=TIMEOUT)
    for r, (same, keys) in enumerate(loaded):
        assert same, f"rank {r}: outputs differ from the saved weights'"
        assert [k for k in keys if k.startswith("experts.gate_up")] == experts[2 * r : 2 * r + 2]


def test_per_expert_keys_round_trip_on_one_rank() -> None:
    layer = _model(0)
    split = layer.state_dict()  # the default
    checkpoint.per_expert_keys(layer, False)
    home = layer.state_dict()
    assert "experts.gate_up_proj" in home and "experts.gate_up_proj.0" not in home
    assert "experts.gate_up_proj" not in split and "experts.gate_up_proj.5" in split
    assert torch.equal(split["experts.down_proj.2"], home["experts.down_proj"][2])
    other = _model(3)
    other.load_state_dict(split)
    assert torch.equal(other.experts.gate_up_proj, home["experts.gate_up_proj"])
    partial = {k: v for k, v in split.items() if k != "experts.gate_up_proj.4"}
    with pytest.raises(RuntimeError, match=r"per-expert keys missing.*experts\.gate_up_proj\.4"):
        other.load_state_dict(partial)
    other = _model(4)
    other.load_state_dict(home)  # the home-rows layout loads in the per-expert mode
    assert torch.equal(other.experts.down_proj, home["experts.down_proj"])
    checkpoint.per_expert_keys(layer)
    assert list(layer.state_dict()) == list(split)
