"""Checkpoints: per-rank files, the original layout, and loading on another number of ranks.

Save a wrapped tiny Mixtral at 2 ranks; consolidate it into the unwrapped layout (equal,
bit for bit, to the original model's state dict); load it into a model wrapped at 3 ranks
(built from other random weights): its logits are bit-identical to those of the original
weights wrapped at 3 ranks, and equal to the unwrapped original's up to rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from moonplan import checkpoint
from moonplan.testing.dist import run_ranks
from tests.adapters.tiny import batch, make_model

pytestmark = pytest.mark.distributed

FAMILY = "DeepseekV3"  # shared experts, a router buffer (correction bias) and MLA attention


def _save(rank: int, world: int, directory: str, order: list[int] | None = None) -> dict:
    from moonplan.adapters import wrap_model

    model = wrap_model(make_model(FAMILY, seed=0), home_order=order)
    path = checkpoint.save_sharded(model, directory)
    full = checkpoint.gather_full_state_dict(model)
    return {"file": path.name, "gathered": full}


def _load(rank: int, world: int, directory: str, how: str, order: list[int] | None = None) -> dict:
    from moonplan.adapters import wrap_model

    original = make_model(FAMILY, seed=0)
    direct = wrap_model(make_model(FAMILY, seed=0))  # the original weights, wrapped at 3 ranks
    model = wrap_model(make_model(FAMILY, seed=1), home_order=order)  # loading must replace all
    if how == "sharded":
        checkpoint.load_sharded(model, directory)
    else:
        checkpoint.load_full(model, original.state_dict())
    ids = batch(rank, [5, 7, 4], seed=9)
    with torch.no_grad():
        got, same = model(input_ids=ids).logits, direct(input_ids=ids).logits
        want = original(input_ids=ids).logits
    return {"identical": torch.equal(got, same), "close": torch.allclose(got, want, atol=1e-6)}


def test_save_at_two_ranks_consolidate_and_load_at_three(tmp_path: Path) -> None:
    saved = run_ranks(_save, 2, str(tmp_path), timeout=60)
    assert [s["file"] for s in saved] == ["rank-00000-of-00002.pt", "rank-00001-of-00002.pt"]
    want = make_model(FAMILY, seed=0).state_dict()
    full = checkpoint.consolidate(tmp_path)
    assert list(full) == list(want)
    for key, value in want.items():
        assert torch.equal(full[key], value), key
        for s in saved:  # the collective, in-memory gather gives the same on every rank
            assert torch.equal(s["gathered"][key], value), key
    for how in ("sharded", "full"):
        for r, got in enumerate(run_ranks(_load, 3, str(tmp_path), how, timeout=60)):
            assert got["identical"], f"{how}: rank {r} logits differ from the same model's"
            assert got["close"], f"{how}: rank {r} logits differ from the original model's"


ORDERS = {"reversed": [5, 4, 3, 2, 1, 0], "mixed": [4, 0, 5, 2, 1, 3]}  # E = 6


@pytest.mark.parametrize(("saved_as", "loaded_as"), [
    ("reversed", None),
    (None, "mixed"),
    ("reversed", "mixed"),
])  # fmt: skip
def test_checkpoints_move_across_home_orders(tmp_path: Path, saved_as, loaded_as) -> None:
    """Rows go by model id: a checkpoint saved under one home order (at 2 ranks)
    consolidates to the original layout and loads under another order (at 3 ranks)."""
    saved = run_ranks(_save, 2, str(tmp_path), ORDERS.get(saved_as), timeout=60)
    want = make_model(FAMILY, seed=0).state_dict()
    full = checkpoint.consolidate(tmp_path)
    for key, value in want.items():
        assert torch.equal(full[key], value), key
        for s in saved:
            assert torch.equal(s["gathered"][key], value), key
    for how in ("sharded", "full"):
        got = run_ranks(_load, 3, str(tmp_path), how, ORDERS.get(loaded_as), timeout=60)
        for r, out in enumerate(got):
            assert out["close"], f"{how}: rank {r} logits differ from the original model's"


def test_incomplete_or_foreign_directories_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no rank-"):
        checkpoint.consolidate(tmp_path)
    run_ranks(_save, 2, str(tmp_path), timeout=60)
    (tmp_path / "rank-00001-of-00002.pt").unlink()
    with pytest.raises(ValueError, match=r"rank-00001-of-00002\.pt: missing"):
        checkpoint.consolidate(tmp_path)
    with pytest.raises(ValueError, match=r"lacks the files of ranks \[1\]"):
        checkpoint.consolidate(tmp_path, verify=False)
