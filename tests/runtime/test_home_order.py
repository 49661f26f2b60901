"""A layer with a ``home_order`` computes the same function as without one.

Legend: R ranks, T tokens (all ranks), H hidden, F ffn, E experts, K top-k.

The runtime works in labels (label ``i`` is model expert ``order[i]``); the router's ids,
the weights given and the checkpoints' keys are model ids. So under any order the
forward output and the gradients of the model's expert weights equal the dense oracle's
(and, for the identity order, those of ``home_order=None`` bit for bit), and a
checkpoint saved under one order loads under another.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moonplan.plan.home_order import popular_order
from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_moe, dense_weights, split, tokens
from tests.runtime.test_layer import _fixed_router, _hot_ids

pytestmark = pytest.mark.distributed

H, F, K, SEED = 8, 12, 2, 3


def _orders(E: int, R: int, ids_TK: torch.Tensor) -> dict[str, list[int] | None]:
    """The orders each case runs: none, the identity, reversed and from popularity."""
    load_E = torch.bincount(ids_TK.reshape(-1), minlength=E)
    return {
        "none": None,
        "identity": list(range(E)),
        "reversed": list(range(E))[::-1],
        "popular": popular_order(load_E, R),
    }


def _layer(E: int, order: list[int] | None, ids_TK, w_TK, offset: int, **options):
    """A ``MoonMoE`` of the dense weights of ``SEED`` with a fixed router."""
    from moonplan import MoonMoE

    w = dense_weights(E, H, F, SEED)
    router = _fixed_router(ids_TK, w_TK, offset)
    layer = MoonMoE(H, F, E, K, router=router, home_order=order, **options)
    layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
    return layer


def _steps(rank: int, world: int, cfg: dict) -> dict[str, dict]:
    """Per order: the output ``y [S, H]``, ``dx [S, H]`` and the home experts' gradients
    (rows of the model ids ``ids``) of the second of two forward/backward steps."""
    sizes, E = cfg["sizes"], cfg["E"]
    offset = sum(sizes[:rank])
    x_SH = split(tokens(sum(sizes), H, SEED), sizes)[rank]
    g_SH = split(cfg["g"], sizes)[rank]
    got = {}
    for name, order in cfg["orders"].items():
        layer = _layer(E, order, cfg["ids"], cfg["w"], offset, slots=cfg["slots"], balance="exact")
        for _ in range(2):  # the second step with resident slots
            layer.zero_grad(set_to_none=True)
            x = x_SH.clone().requires_grad_(True)
            y = layer(x)
            (y * g_SH).sum().backward()
        assert layer.last_stats is not None
        got[name] = {
            "y": y.detach(),
            "dx": x.grad,
            "gate_up": layer.gate_up.grad,
            "down": layer.down.grad,
            "ids": layer.home_experts.tolist(),
            "copies": layer.last_stats.copies,
        }
    return got


def _dense(cfg: dict) -> dict[str, torch.Tensor]:
    """The dense oracle's output, ``dx`` and weight gradients ``[E, ...]`` (by model id)."""
    w = dense_weights(cfg["E"], H, F, SEED)
    for k in ("gate_up", "down"):
        w[k].requires_grad_(True)
    x = tokens(sum(cfg["sizes"]), H, SEED).requires_grad_(True)
    y = dense_moe(x, cfg["ids"], cfg["w"], w)
    (y * cfg["g"].double()).sum().backward()
    return {"y": y.detach().float(), "dx": x.grad, "gate_up": w["gate_up"].grad,
            "down": w["down"].grad}  # fmt: skip


CASES = [  # (R, E, sizes, slots)
    (1, 5, [9], None),
    (2, 6, [9, 5], None),
    (3, 7, [6, 0, 8], None),  # a rank without tokens, E mod R != 0
    (3, 7, [6, 5, 8], 0),  # no slots: every replica a direct read
]


@pytest.mark.parametrize(("world", "E", "sizes", "slots"), CASES)
def test_any_order_computes_the_dense_function(world, E, sizes, slots) -> None:
    T = sum(sizes)
    ids, wk = _hot_ids(T, E, K, SEED)  # expert 0 hot: replicas run
    g = torch.randn(T, H, generator=torch.Generator().manual_seed(11))
    orders = _orders(E, world, ids)
    cfg = {"E": E, "sizes": sizes, "slots": slots, "ids": ids, "w": wk, "g": g, "orders": orders}
    got = run_ranks(_steps, world, cfg, timeout=120)
    want = _dense(cfg)
    for name in orders:
        for key in ("y", "dx"):
            mine = torch.cat([r[name][key] for r in got if r[name][key].numel()])
            torch.testing.assert_close(mine, want[key].float(), rtol=1e-5, atol=1e-5)
        for r, ranks in enumerate(got):
            ids_Er = ranks[name]["ids"]
            if orders[name] is not None:  # this rank owns the model ids of its label block
                assert ids_Er == [orders[name][a] for a in _block(r, E, world)]
            for key in ("gate_up", "down"):
                torch.testing.assert_close(
                    ranks[name][key].double(), want[key][ids_Er].double(), rtol=1e-5, atol=1e-6
                )
        if world > 1:
            assert got[0][name]["copies"] > 0, f"{name}: the hot expert has no replica"
    for ranks in got:  # the identity order is home_order=None, bit for bit
        for key, value in ranks["none"].items():
            same = value == ranks["identity"][key]
            assert same if isinstance(same, bool) else bool(same.all()), key


def _block(rank: int, E: int, R: int) -> range:
    from moonplan.plan.home import home_start

    return range(home_start(rank, E, R), home_start(rank + 1, E, R))


def _state(rank: int, world: int, E: int, order: list[int]) -> dict[str, torch.Tensor]:
    """This rank's per-expert state dict of a layer with ``order`` (the default keys)."""
    ids, wk = _hot_ids(12, E, K, SEED)
    sd = _layer(E, order, ids, wk, 0).state_dict()
    return {k: v.clone() for k, v in sd.items()}


def _reload(rank: int, world: int, E: int, states: list[dict], order) -> torch.Tensor:
    """Output of a layer with ``order`` and other weights, loaded from the per-expert keys
    of every saving rank (as a DCP load reads them), minus the original layer's."""
    from moonplan import MoonMoE

    ids, wk = _hot_ids(12 * world, E, K, SEED)
    torch.manual_seed(100 + rank)
    router = _fixed_router(ids, wk, 12 * rank)
    layer = MoonMoE(H, F, E, K, router=router, home_order=order)  # random weights
    union = {k: v for sd in states for k, v in sd.items()}
    layer.load_state_dict(union)
    x = tokens(12 * world, H, 5)[12 * rank : 12 * (rank + 1)]
    direct = _layer(E, None, ids, wk, 12 * rank)
    with torch.no_grad():
        return layer(x) - direct(x)


def test_per_expert_keys_load_across_orders_and_ep_sizes() -> None:
    E = 7
    saved = run_ranks(_state, 2, E, list(range(E))[::-1], timeout=60)
    assert sorted(k for sd in saved for k in sd if k.startswith("experts.down_proj.")) == sorted(
        f"experts.down_proj.{e}" for e in range(E)
    )  # one key per model id over the ranks
    popular = popular_order(torch.arange(E), 3)
    for order in (None, popular, [3, 0, 6, 1, 5, 2, 4]):
        for diff in run_ranks(_reload, 3, E, saved, order, timeout=60):
            torch.testing.assert_close(diff, torch.zeros_like(diff), rtol=0, atol=1e-6)


def _bad(rank: int, world: int, kind: str) -> str:
    from moonplan import MoonMoE
    from moonplan.comm.errors import ContractError

    E = 4
    orders = {
        "invalid": [[0, 1, 2, 3], [0, 0, 1, 2]],  # rank 1: not a permutation
        "differ": [[3, 2, 1, 0], [0, 1, 2, 3]],  # valid, but not the same
    }
    try:
        MoonMoE(H, F, E, K, home_order=orders[kind][rank])
    except ContractError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize(("kind", "words"), [
    ("invalid", "home_order must hold each of the 4 experts once"),
    ("differ", "home_order"),
])  # fmt: skip
def test_orders_that_are_bad_or_differ_raise_on_every_rank(kind: str, words: str) -> None:
    got = run_ranks(_bad, 2, kind, timeout=60)
    assert got[0] == got[1] != ""
    assert words in got[0] and "rank 1" in got[0], got[0]


def test_a_bad_order_is_refused_when_the_config_is_made() -> None:
    from moonplan import MoEConfig, MoonMoE

    with pytest.raises(ValueError, match="home_order must hold each of the 4 experts once"):
        MoonMoE(H, F, 4, K, home_order=[0, 1, 2])
    with pytest.raises(ValueError, match="home_order must be a sequence of expert ids"):
        MoEConfig(num_experts=3, home_order=[0, 1, 2.0])
    cfg = MoEConfig(home_order=[2, 0, 1])  # E unknown: a permutation of its own length
    assert cfg.home_order == (2, 0, 1) and cfg.sized(num_experts=3).home_order == (2, 0, 1)
    with pytest.raises(ValueError, match="each of the 4 experts"):
        cfg.sized(num_experts=4)
    for given in (torch.tensor([2, 0, 1]), np.array([2, 0, 1])):  # other containers
        assert MoEConfig(num_experts=3, home_order=given).home_order == (2, 0, 1)
    assert MoEConfig(num_experts=3, home_order=range(3)).home_order == (0, 1, 2)


def _grouped(rank: int, world: int, order: list[int] | None) -> dict:
    """torchtitan's ``MoonGroupedExperts`` (plain tensors; torchtitan not needed) with
    ``order``: its home rows and its output for hot routing."""
    from moonplan.adapters.torchtitan import MoonGroupedExperts

    E, D, FF, S = 5, 8, 6, 7
    g = torch.Generator().manual_seed(4)
    w1, w3 = (torch.randn(E, FF, D, generator=g) for _ in range(2))
    w2 = torch.randn(E, D, FF, generator=g)
    ids, wk = _hot_ids(S * world, E, K, 4)
    ex = MoonGroupedExperts(w1, w2, w3, K, compute_dtype=torch.float32, home_order=order)
    x = tokens(S * world, D, 4)[S * rank : S * (rank + 1)]
    with torch.no_grad():
        y = ex.run(x, ids[S * rank : S * (rank + 1)], wk[S * rank : S * (rank + 1)])
    home = ex.home_experts.tolist()
    rows_ok = all(torch.equal(getattr(ex, n), w[home]) for n, w in
                  (("w1_EFD", w1), ("w2_EDF", w2), ("w3_EFD", w3)))  # fmt: skip
    return {"y": y, "rows_ok": rows_ok, "repr": repr(ex)}


def test_torchtitan_experts_take_their_rows_by_model_id() -> None:
    plain = run_ranks(_grouped, 2, None, timeout=60)
    ordered = run_ranks(_grouped, 2, [4, 2, 0, 1, 3], timeout=60)
    for a, b in zip(plain, ordered, strict=True):
        assert b["rows_ok"] and a["rows_ok"]
        torch.testing.assert_close(a["y"], b["y"], rtol=1e-5, atol=1e-5)
    assert "home=[4, 2, 0]" in ordered[0]["repr"] and "home=[0, 3)" in plain[0]["repr"]


def test_recorded_traces_count_model_ids() -> None:
    """A trace recorded under a home order counts model experts (not labels)."""
    from moonplan.traces.recorder import TraceRecorder

    E, T = 5, 9
    ids, wk = _hot_ids(T, E, K, SEED)
    layer = _layer(E, [3, 1, 4, 0, 2], ids, wk, 0)
    with TraceRecorder(layer) as rec, torch.no_grad():
        layer.experts(tokens(T, H, SEED), ids, wk)  # a block calls its experts so
    want_E = torch.bincount(ids.reshape(-1), minlength=E)
    assert torch.equal(rec.counts("experts")[0, 0], want_E)
