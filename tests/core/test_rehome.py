"""Re-homing a running layer (``moonplan.core.rehome``, ``ShardedExperts.rehome``).

Legend: R ranks, T tokens (all ranks), H hidden, F ffn, E experts, K top-k.

The moves are checked on their own (every rank's rows land where the new order puts
them); a layer re-homed between steps computes the dense oracle's function, keeps its
checkpoint keys, and in training carries gradients and optimizer state with the rows, so
training on equals training without the move.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonplan.core.rehome import full_order, home_moves, row_tensors
from moonplan.plan.home import home_edges
from moonplan.plan.home_order import popular_order
from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_moe, dense_weights, split, tokens
from tests.runtime.test_layer import _fixed_router, _hot_ids

H, F, K, SEED = 8, 12, 2, 3


def _simulate(old: list[int], new: list[int], R: int) -> list[list[int]]:
    """Every rank's new rows after the moves, each row holding its model id (the moves
    run as the all-to-all would carry them)."""
    edges = home_edges(len(old), R)
    rows_R = [old[edges[r] : edges[r + 1]] for r in range(R)]
    moves_R = [home_moves(old, new, R, r) for r in range(R)]
    sent = {}  # (src, dst) -> rows in order
    for src, m in enumerate(moves_R):
        at = 0
        for dst, n in enumerate(m.send_splits):
            sent[src, dst] = [rows_R[src][i] for i in m.send_rows[at : at + n]]
            at += n
    out = []
    for dst, m in enumerate(moves_R):
        got = [e for src in range(R) for e in sent[src, dst]]
        assert [n for n in m.recv_splits] == [len(sent[s, dst]) for s in range(R)]
        new_rows = [-1] * (edges[dst + 1] - edges[dst])
        for row, e in zip(m.recv_rows, got, strict=True):
            new_rows[row] = e
        out.append(new_rows)
    return out


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(1, 12), st.randoms(use_true_random=False))
def test_moves_put_every_expert_where_the_new_order_says(R, E, rnd) -> None:
    old, new = list(range(E)), list(range(E))
    rnd.shuffle(old)
    rnd.shuffle(new)
    edges = home_edges(E, R)
    got = _simulate(old, new, R)
    assert got == [new[edges[r] : edges[r + 1]] for r in range(R)]
    owner_old = {e: r for r in range(R) for e in old[edges[r] : edges[r + 1]]}
    owner_new = {e: r for r in range(R) for e in new[edges[r] : edges[r + 1]]}
    want = sum(owner_old[e] != owner_new[e] for e in range(E))
    assert all(home_moves(old, new, R, r).moved == want for r in range(R))


def test_the_same_order_moves_nothing_off_rank() -> None:
    order = [3, 1, 4, 0, 2, 5]
    for r in range(3):
        m = home_moves(order, order, 3, r)
        assert m.moved == 0 and m.send_splits[r] == m.recv_splits[r] == 2
        assert sum(m.send_splits) == 2
    assert full_order(None, 3) == [0, 1, 2]


def test_row_tensors_follow_grad_and_optimizer_state_and_refuse_other_shapes() -> None:
    p = torch.nn.Parameter(torch.randn(3, 4))
    opt = torch.optim.Adam([p])
    only = row_tensors(p, [opt])  # no grad, no state yet: the data alone
    assert len(only) == 1 and only[0].data_ptr() == p.data_ptr()
    p.sum().backward()
    opt.step()
    got = row_tensors(p, [opt])
    state = opt.state[p]
    assert len(got) == 4  # data, grad, exp_avg, exp_avg_sq (step is scalar: stays)
    assert got[1] is p.grad and any(t is state["exp_avg"] for t in got)
    state["factored"] = torch.zeros(3)
    with pytest.raises(ValueError, match="'factored' of shape \\(3,\\)"):
        row_tensors(p, [opt])


# ---- a layer re-homed between steps --------------------------------------------------


def _layer(E: int, ids_TK, w_TK, offset: int, **options):
    from moonplan import MoonMoE

    w = dense_weights(E, H, F, SEED)
    layer = MoonMoE(H, F, E, K, router=_fixed_router(ids_TK, w_TK, offset), **options)
    layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
    return layer


def _served(rank: int, world: int, cfg: dict) -> dict:
    """Outputs of one step before and after each re-homing (eval mode, no grad), the
    experts moved and the home ids after each."""
    sizes, E = cfg["sizes"], cfg["E"]
    offset = sum(sizes[:rank])
    x_SH = split(tokens(sum(sizes), H, SEED), sizes)[rank]
    layer = _layer(E, cfg["ids"], cfg["w"], offset, home_order=cfg["first"], **cfg["options"])
    layer.eval()
    keys = {k: v.clone() for k, v in layer.state_dict().items()}
    out: dict = {"y": [], "moved": [], "ids": [], "order": []}
    with torch.no_grad():
        for order in [None, *cfg["orders"]]:
            if order is not None:
                before = full_order(layer.experts.home_order, E)
                out["moved"].append(layer.rehome(order))
                changed = full_order(order, E) != before
                assert (layer.last_plan is None) == changed  # labels changed meaning
            for _ in range(2):  # the second step with resident slots
                y = layer(x_SH)
            out["y"].append(y)
            out["ids"].append(layer.home_experts.tolist())
            out["order"].append(layer.experts.home_order)
            assert layer.config.sizes.home_order == layer.experts.home_order
    after = layer.state_dict()
    assert sorted(after) == sorted(keys)
    out["same_keys"] = all(bool(torch.equal(after[k], v)) for k, v in keys.items())
    return out


CASES = [  # (R, E, sizes, options)
    (1, 5, [9], {}),
    (2, 6, [9, 5], {"balance": "exact"}),
    (3, 7, [6, 0, 8], {"balance": "exact"}),  # a rank without tokens, E mod R != 0
    (3, 7, [6, 5, 8], {"balance": "auto", "transport": "a2a"}),
    (4, 9, [5, 7, 0, 6], {"slots": 0, "balance": "exact"}),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "E", "sizes", "options"), CASES)
def test_a_rehomed_layer_computes_the_dense_function(world, E, sizes, options) -> None:
    T = sum(sizes)
    ids, wk = _hot_ids(T, E, K, SEED)
    reverse = list(range(E))[::-1]
    orders = [reverse, popular_order(torch.bincount(ids.reshape(-1), minlength=E), world),
              list(range(E))]  # fmt: skip
    cfg = {"E": E, "sizes": sizes, "ids": ids, "w": wk, "first": None, "orders": orders,
           "options": options}  # fmt: skip
    got = run_ranks(_served, world, cfg, timeout=180)
    want = dense_moe(tokens(T, H, SEED), ids, wk, dense_weights(E, H, F, SEED)).float()
    edges = home_edges(E, world)
    for i, order in enumerate([None, *orders]):
        mine = torch.cat([r["y"][i] for r in got if r["y"][i].numel()])
        torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-5)
        full = full_order(order, E)
        assert [r["ids"][i] for r in got] == [full[edges[r] : edges[r + 1]] for r in range(world)]
    for r in got:
        assert r["same_keys"]  # the per-expert keys name the same rows after every move
        assert r["order"][-1] is None  # the identity order restores the linear map
        assert r["moved"] == got[0]["moved"]
    if world > 1:
        assert got[0]["moved"][0] > 0


def _trained(rank: int, world: int, cfg: dict) -> dict:
    """Weights by model id after three Adam steps, re-homed after the first (or not)."""
    from moonplan.adapters.checkpoint import gather_full_state_dict

    sizes, E = cfg["sizes"], cfg["E"]
    offset = sum(sizes[:rank])
    x_SH = split(tokens(sum(sizes), H, SEED), sizes)[rank]
    layer = _layer(E, cfg["ids"], cfg["w"], offset, balance="exact")
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        loss = (layer(x_SH) ** 2).sum()
        loss.backward()
        if step == 1 and cfg["order"] is not None:  # grads held: they move too
            layer.rehome(cfg["order"], optimizers=[opt])
        opt.step()
        losses.append(float(loss))
    full = gather_full_state_dict(layer)
    return {"losses": losses, **{k: v for k, v in full.items() if "experts" in k}}


@pytest.mark.distributed
def test_training_on_after_a_rehome_equals_training_without_it() -> None:
    world, E, sizes = 3, 7, [8, 6, 7]
    ids, wk = _hot_ids(sum(sizes), E, K, SEED)
    base = {"E": E, "sizes": sizes, "ids": ids, "w": wk}
    plain = run_ranks(_trained, world, {**base, "order": None}, timeout=120)
    moved = run_ranks(_trained, world, {**base, "order": list(range(E))[::-1]}, timeout=120)
    for a, b in zip(plain, moved, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if key == "losses":
                assert a[key] == pytest.approx(b[key], rel=1e-5)
            else:
                torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def _refused(rank: int, world: int, kind: str) -> str:
    from moonplan.comm.errors import ContractError

    ids, wk = _hot_ids(8, 4, K, SEED)
    layer = _layer(4, ids, wk, 0)
    orders = {"invalid": [[3, 2, 1, 0], [0, 0, 1, 2]], "differ": [[3, 2, 1, 0], [0, 1, 2, 3]],
              "training": [[3, 2, 1, 0]] * 2}  # fmt: skip
    if kind != "training":
        layer.eval()
    try:
        layer.rehome(orders[kind][rank])
    except (ContractError, ValueError) as exc:
        assert layer.experts.home_order is None  # nothing changed
        return f"{type(exc).__name__}: {exc}"
    return ""


@pytest.mark.distributed
@pytest.mark.parametrize(("kind", "words"), [
    ("invalid", "home_order must hold each of the 4 experts once"),
    ("differ", "home order"),
    ("training", "rehome in training mode needs optimizers="),
])  # fmt: skip
def test_a_bad_rehome_raises_the_same_error_on_every_rank(kind: str, words: str) -> None:
    got = run_ranks(_refused, 2, kind, timeout=60)
    assert got[0] == got[1] != ""
    assert words in got[0], got[0]


def _profiled(rank: int, world: int, cfg: dict) -> dict:
    """``rehome("profile")`` before any step (the error), then after steps: the recent
    loads by model id across an explicit re-home, the profile's order, a second call."""
    from moonplan.comm.errors import ContractError

    sizes, E = cfg["sizes"], cfg["E"]
    x_SH = split(tokens(sum(sizes), H, SEED), sizes)[rank]
    layer = _layer(E, cfg["ids"], cfg["w"], sum(sizes[:rank]), balance="exact").eval()
    out: dict = {}
    try:
        layer.rehome("profile")
    except (ValueError, ContractError) as exc:
        out["early"] = str(exc)
    with torch.no_grad():
        for _ in range(2):
            layer(x_SH)
        out["loads0"] = layer.runtime.recent_loads().tolist()
        out["moved_reverse"] = layer.rehome(list(range(E))[::-1])
        out["loads1"] = layer.runtime.recent_loads().tolist()
        layer(x_SH)
        out["moved_profile"] = layer.rehome("profile")
        out["order"] = list(layer.experts.home_order or range(E))
        out["y"] = layer(x_SH)
        out["moved_again"] = layer.rehome("profile")
        out["kept_plan"] = layer.last_plan is not None  # nothing moved: the slots stay
    return out


@pytest.mark.distributed
def test_rehome_from_the_layers_own_profile() -> None:
    world, E, sizes = 3, 7, [6, 5, 8]
    ids, wk = _hot_ids(sum(sizes), E, K, SEED)
    got = run_ranks(_profiled, world, {"E": E, "sizes": sizes, "ids": ids, "w": wk}, timeout=120)
    load_E = torch.bincount(ids.reshape(-1), minlength=E)
    reverse = list(range(E))[::-1]
    want_order = popular_order(3 * load_E, world, reverse)
    want_y = dense_moe(tokens(sum(sizes), H, SEED), ids, wk, dense_weights(E, H, F, SEED))
    assert got[0]["early"] == got[1]["early"] != ""
    assert "needs the loads of a step" in got[0]["early"]
    for g in got:
        assert g["loads0"] == g["loads1"] == (2 * load_E).tolist()  # model ids, relabelled
        assert g["order"] == want_order and want_order != reverse
        assert g["moved_profile"] > 0 and g["moved_again"] == 0 and g["kept_plan"]
    mine = torch.cat([g["y"] for g in got])
    torch.testing.assert_close(mine, want_y.float(), rtol=1e-5, atol=1e-5)


def test_rehome_model_profile_names_every_layer() -> None:
    from moonplan import MoonMoE
    from moonplan.adapters import rehome_model

    model = torch.nn.Sequential(MoonMoE(H, F, 4, K), MoonMoE(H, F, 4, K)).eval()
    with pytest.raises(ValueError, match="permutation or 'profile', got 'popular'"):
        model[0].rehome("popular")
    with torch.no_grad():
        model(torch.randn(5, H))
    assert rehome_model(model, "profile") == {"0.experts": 0, "1.experts": 0}  # one rank


def _judged(rank: int, world: int, cfg: dict) -> dict:
    """``rehome("profile")`` of an ``auto`` layer with a cost model: its window, its order,
    and after it the placer's way and the steps its window holds (``None``: no placer)."""
    sizes, E = cfg["sizes"], cfg["E"]
    x_SH = split(tokens(sum(sizes), H, SEED), sizes)[rank]
    layer = _layer(E, cfg["ids"], cfg["w"], sum(sizes[:rank]), balance="auto",
                   cost=cfg["cost"], slots=cfg["slots"]).eval()  # fmt: skip
    with torch.no_grad():
        for _ in range(3):
            layer(x_SH)
        loads = layer.runtime.window.loads().clone()
        resident = layer.runtime.resident
        serving = resident.slot_expert.clone() if resident is not None else None
        moved = layer.rehome("profile")
        decisions = layer.runtime.placer.decisions
        way = None if decisions is None else decisions.way(stale=False)
        held = None if decisions is None else decisions.residency.window.filled
        y = layer(x_SH)
    return {"loads": loads, "moved": moved, "order": layer.experts.home_order, "y": y,
            "serving": serving, "way": way, "held": held}  # fmt: skip


def _uniform_ids(T: int, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ``t`` routes to experts ``t mod E`` and ``t + 1 mod E``: even loads."""
    t = torch.arange(T)
    return torch.stack([t % E, (t + 1) % E], 1), torch.full((T, K), 0.5)


def _skewed_ids(T: int, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two distinct experts per token drawn from a lognormal popularity: loads
    ``[17, 11, 3, 0, 4, 7, 6, 0]`` at ``T = 24, E = 8``, where the order of loads per
    replica (``home_choice.shared_order``) is judged faster than ``popular_order``."""
    g = torch.Generator().manual_seed(24)
    p_E = torch.exp(torch.randn(E, generator=g) * 1.5)
    ids = torch.stack([torch.multinomial(p_E, 2, replacement=False, generator=g) for _ in range(T)])
    return ids, torch.full((T, K), 0.5)


ROUTINGS = {"hot": lambda T, E: _hot_ids(T, E, K, SEED), "uniform": _uniform_ids,
            "skewed": _skewed_ids}  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize(("routing", "slots", "taken"), [
    ("hot", 0, True), ("hot", 2, True), ("uniform", 2, False), ("skewed", 2, True),
])  # fmt: skip
def test_an_auto_layer_takes_the_profile_order_only_where_its_cost_model_favours_it(
    routing, slots, taken
):
    """Even loads: ``popular_order`` is another permutation (ties), no faster: not taken.
    Skewed loads with slots: the order of loads per replica is taken."""
    from moonplan.plan.residency.home_choice import judged_order, shared_order
    from tests.baselines.test_auto_ordered import COST

    world, E, sizes = 2, 8, [12, 12]
    ids, wk = ROUTINGS[routing](sum(sizes), E)
    cfg = {"E": E, "sizes": sizes, "ids": ids, "w": wk, "cost": COST, "slots": slots}
    got = run_ranks(_judged, world, cfg, timeout=120)
    serving = got[0]["serving"]
    if serving is None:
        serving = torch.full((world, slots), -1, dtype=torch.int64)
    judged = judged_order(COST, got[0]["loads"], world, slots, serving)
    perm = None if judged is None else judged.perm_E
    assert (perm is not None) == taken
    if not taken:
        assert popular_order(got[0]["loads"].sum(0), world, list(range(E))) != list(range(E))
    if routing == "skewed":
        assert perm is not None and list(perm) == shared_order(got[0]["loads"], world, slots)
        assert list(perm) != popular_order(got[0]["loads"].sum(0), world, list(range(E)))
    for g in got:
        assert g["order"] == (None if perm is None else tuple(perm))
        assert (g["moved"] > 0) == taken
        assert (g["held"], g["way"] is None) == ((3, False) if slots else (None, True))
        if taken and slots:  # the way the order was judged by (not calls), its window kept
            assert g["way"] == judged.serve != "call"
    want = dense_moe(tokens(sum(sizes), H, SEED), ids, wk, dense_weights(E, H, F, SEED))
    torch.testing.assert_close(torch.cat([g["y"] for g in got]), want.float(), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


# ---- balance="auto" re-homes by itself, once, while serving -------------------------------
def _served_on(rank: int, world: int, cfg: dict) -> dict:
    """34 steps of an auto layer (with a cost model, no slots: nothing serves better than
    its map): the home order before and after the step where its window first fills,
    and the last output. ``grad_step``: one step
    with autograd on first (a trained layer: never re-homes by itself)."""
    from moonplan.plan.residency.window import WINDOW

    sizes, E = cfg["sizes"], cfg["E"]
    x_SH = split(tokens(sum(sizes), H, SEED), sizes)[rank]
    layer = _layer(E, cfg["ids"], cfg["w"], sum(sizes[:rank]), balance="auto",
                   cost=cfg["cost"], slots=0, **cfg["options"])  # fmt: skip
    if cfg["grad_step"]:
        layer(x_SH).sum().backward()
    orders = []
    with torch.no_grad():
        for _ in range(WINDOW + 3):
            y = layer(x_SH)
            orders.append(layer.experts.home_order)
    return {"orders": orders, "y": y, "loads": layer.runtime.window.loads().clone()}


@pytest.mark.distributed
@pytest.mark.parametrize(("options", "grad_step", "rehomes"), [
    ({}, False, True), ({"rehome": False}, False, False), ({}, True, False),
])  # fmt: skip
def test_auto_rehomes_by_itself_once_while_serving(options, grad_step, rehomes) -> None:
    from moonplan.plan.residency.window import WINDOW
    from tests.baselines.test_auto_ordered import COST

    world, E, sizes = 2, 8, [12, 10]
    ids, wk = _hot_ids(sum(sizes), E, K, SEED)
    cfg = {"E": E, "sizes": sizes, "ids": ids, "w": wk, "cost": COST, "options": options,
           "grad_step": grad_step}  # fmt: skip
    got = run_ranks(_served_on, world, cfg, timeout=180)
    assert got[0]["orders"] == got[1]["orders"]
    orders = got[0]["orders"]
    assert set(orders[:WINDOW]) == {None}  # the linear map until the window is full
    if rehomes:  # at the step after it fills, to the order its window favours, then kept
        want = tuple(popular_order(3 * torch.bincount(ids.reshape(-1), minlength=E), world,
                                   list(range(E))))  # fmt: skip
        assert orders[WINDOW] == orders[WINDOW + 2] == want
    else:
        assert set(orders) == {None}
    dense = dense_moe(tokens(sum(sizes), H, SEED), ids, wk, dense_weights(E, H, F, SEED))
    torch.testing.assert_close(torch.cat([g["y"] for g in got]), dense.float(), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


def _profiled_in_training(rank: int, world: int, cfg: dict) -> dict:
    """``rehome("profile")`` of an auto layer after three training steps: its window, the
    order taken and how it was judged (``stale``, seen through a wrapper)."""
    import moonplan.core.sharded as sharded
    from tests.baselines.test_auto_ordered import COST

    seen: list[bool] = []
    judge = sharded.judged_order

    def spy(*args, **kwargs):
        seen.append(kwargs.get("stale", False))
        return judge(*args, **kwargs)

    sharded.judged_order = spy  # this rank's process only

    sizes, E = cfg["sizes"], cfg["E"]
    x_SH = split(tokens(sum(sizes), H, SEED), sizes)[rank]
    layer = _layer(E, cfg["ids"], cfg["w"], sum(sizes[:rank]), balance="auto", cost=COST,
                   slots=2, rehome=False)  # fmt: skip
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        layer(x_SH).sum().backward()
        opt.step()
    loads = layer.runtime.window.loads().clone()
    layer.rehome("profile", optimizers=[opt])
    return {"loads": loads, "order": layer.experts.home_order, "stale": seen}


@pytest.mark.distributed
def test_after_training_steps_the_profile_is_judged_with_no_slot_kept() -> None:
    from moonplan.plan.residency.home_choice import judged_order
    from tests.baselines.test_auto_ordered import COST

    world, E, sizes = 2, 8, [12, 12]
    ids, wk = _hot_ids(sum(sizes), E, K, SEED)
    got = run_ranks(_profiled_in_training, world,
                    {"E": E, "sizes": sizes, "ids": ids, "w": wk}, timeout=120)  # fmt: skip
    want = judged_order(COST, got[0]["loads"], world, 2, stale=True)
    assert want is not None
    assert got[0]["order"] == got[1]["order"] == want.perm_E
    assert got[0]["stale"] == got[1]["stale"] == [True]  # no slot outlives a training step
