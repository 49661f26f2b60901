"""``wrap_model``: a whole transformers model, wrapped, computes what the original computes.

Every rank has its own batch; logits, loss (with the router's auxiliary loss where the
family has one) and the gradients of every non-expert parameter equal the unwrapped
model's on that batch; home expert gradients equal the all-reduced (total) gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from moonplan.testing.dist import run_ranks
from tests.adapters.checks import rel_close
from tests.adapters.tiny import batch, make_model

pytestmark = pytest.mark.distributed


def _rank(rank: int, world: int, family: str, sizes: list[int], orders=None) -> dict:
    from moonplan import adapters

    model = make_model(family)
    ref = copy.deepcopy(model)
    adapters.wrap_model(model, home_order=orders)
    layers = dict(adapters.moon_experts(model))
    sharded = set(adapters.expert_parameter_names(model))
    ids = batch(rank, sizes, seed=3)
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    out0 = ref(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    out0.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    checked = 0
    for name, p in model.named_parameters():
        want = ref_grads[name]
        layer = name.rpartition(".")[0]
        assert (layer in layers) == (name in sharded)
        if layer in layers:  # expert tensor: the gradient of the sum of every rank's loss
            dist.all_reduce(want)
            want = want[layers[layer].home_experts]
        rel_close(p.grad, want, what=f"rank {rank} {name} grad")
        checked += 1
    rel_close(out.logits, out0.logits, what=f"rank {rank} logits")
    rel_close(out.loss, out0.loss, what=f"rank {rank} loss")
    if out0.aux_loss is not None:
        rel_close(out.aux_loss, out0.aux_loss, what=f"rank {rank} aux loss")
    return {"layers": sorted(layers), "checked": checked,
            "homes": {n: ex.home_experts.tolist() for n, ex in layers.items()}}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "world", "sizes"),
    [
        ("Mixtral", 1, [6]),
        ("Mixtral", 2, [5, 9]),
        ("Mixtral", 4, [4, 7, 3, 6]),
        ("Qwen3Moe", 3, [6, 4, 8]),
        ("DeepseekV3", 3, [7, 5, 3]),
    ],
)
def test_wrapped_model_matches_original(family: str, world: int, sizes: list[int]) -> None:
    got = run_ranks(_rank, world, family, sizes, timeout=60)
    want = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(g["layers"] == want for g in got)
    assert len({g["checked"] for g in got}) == 1


def test_an_order_per_block() -> None:
    """``home_order={block name: order}``: each named block owns its order's experts (the
    others the linear blocks), and the model still matches the original, gradients too."""
    orders = {"model.layers.0.mlp": [5, 4, 3, 2, 1, 0]}  # Mixtral's tiny model: E = 6
    got = run_ranks(_rank, 2, "Mixtral", [5, 9], orders, timeout=60)
    assert [g["homes"]["model.layers.0.mlp.experts"] for g in got] == [[5, 4, 3], [2, 1, 0]]
    assert [g["homes"]["model.layers.1.mlp.experts"] for g in got] == [[0, 1, 2], [3, 4, 5]]


def test_an_order_for_no_block_is_refused() -> None:
    from moonplan import adapters

    with pytest.raises(ValueError, match=r"no MoE block: \['model.layers.0'\]"):
        adapters.wrap_model(make_model("Mixtral"), home_order={"model.layers.0": [0, 1]})


def _rehomed(rank: int, world: int, sizes: list[int]) -> dict:
    """A wrapped model's logits before and after ``rehome_model`` (eval, no grad), the
    experts moved and the home ids after."""
    from moonplan import adapters

    model = adapters.wrap_model(make_model("Mixtral")).eval()
    ids = batch(rank, sizes, seed=3)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        moved = adapters.rehome_model(model, {"model.layers.1.mlp.experts": [1, 3, 5, 0, 2, 4]})
        after = model(input_ids=ids).logits
    homes = {n: ex.home_experts.tolist() for n, ex in adapters.moon_experts(model)}
    return {"before": before, "after": after, "moved": moved, "homes": homes}


def test_rehome_model_moves_the_named_layers_and_keeps_the_function() -> None:
    got = run_ranks(_rehomed, 2, [5, 9], timeout=60)
    assert [g["homes"]["model.layers.1.mlp.experts"] for g in got] == [[1, 3, 5], [0, 2, 4]]
    assert [g["homes"]["model.layers.0.mlp.experts"] for g in got] == [[0, 1, 2], [3, 4, 5]]
    assert all(g["moved"] == {"model.layers.1.mlp.experts": 4} for g in got)
    for r, g in enumerate(got):
        rel_close(g["after"], g["before"], what=f"rank {r} logits")


def test_rehome_model_refuses_a_name_without_experts() -> None:
    from moonplan import adapters

    model = adapters.wrap_model(make_model("Mixtral")).eval()
    with pytest.raises(ValueError, match=r"hold no sharded experts: \['model.layers.1.mlp'\]"):
        adapters.rehome_model(model, {"model.layers.1.mlp": list(range(6))})
