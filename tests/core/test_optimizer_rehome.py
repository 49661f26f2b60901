"""``balance="auto"`` re-homes by itself in training, with the state of the optimizer
that stepped its experts (``moonplan.core.optimizer_rehome``,
``ShardedExperts.optimizer_stepped``, ``ShardedExperts.step_begins``).

Legend: R ranks, T tokens (all ranks), H hidden, E experts, K top-k.

The hook tells each watched layer of every optimizer step and forgets the done ones; an
auto layer in training re-homes where its decisions offer it, at the start of a step, on
every rank alike, and trains on as it would have without the move; an optimizer that
holds only some of its tensors, or ``rehome=False``, leaves it where it is; ranks whose
optimizers differ get the same error, and none hangs.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from moonplan.core.optimizer_rehome import watch, watched
from moonplan.plan.home_order import popular_order
from moonplan.testing.dist import run_ranks
from tests.core.test_rehome import SEED, H, K, _layer
from tests.runtime.oracle import split, tokens
from tests.runtime.test_layer import _hot_ids


class _Told:
    """A watched layer that records the steps it is told of; done after ``done`` of them."""

    def __init__(self, done: int) -> None:
        self.told: list[tuple[torch.optim.Optimizer, set[int]]] = []
        self.done = done

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer, held: set[int]) -> bool:
        self.told.append((optimizer, held))
        return len(self.told) >= self.done


def test_each_optimizer_step_tells_the_watched_layers_until_they_are_done() -> None:
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [q]}], lr=0.1)
    once, twice = _Told(1), _Told(2)
    watch(once)
    watch(twice)
    for _ in range(3):
        p.grad, q.grad = torch.ones(2), torch.ones(3)
        opt.step()
    assert [len(once.told), len(twice.told)] == [1, 2]  # forgotten once done
    assert once.told[0] == (opt, {id(p), id(q)})
    gone = _Told(5)
    watch(gone)
    assert gone in watched()
    del gone
    gc.collect()
    assert all(not isinstance(w, _Told) for w in watched())  # collected: forgotten


def _trained_auto(rank: int, world: int, cfg: dict) -> dict:
    """``STEPS`` Adam steps of an auto layer (a cost model whose copies are cheap, so that
    a re-home pays within a few steps; 2 slots): its home order after
    each, the steps its placer's window holds after each, the losses, the warnings,
    ``move_bytes`` and the experts' weights by model id."""
    from moonplan.adapters.checkpoint import gather_full_state_dict
    from tests.plan.choice.costs import rows_only

    sizes, E = cfg["sizes"], cfg["E"]
    x_SH = split(tokens(sum(sizes), H, SEED), sizes)[rank]
    cost = rows_only(copy_s_intra=1e-6, copy_s_inter=1e-6, plan_s=1e-5)  # moves pay at once
    layer = _layer(E, cfg["ids"], cfg["w"], sum(sizes[:rank]), balance="auto", cost=cost,
                   slots=2, **cfg["options"])  # fmt: skip
    experts = layer.experts
    if cfg["split"]:  # the experts' two tensors under two optimizers
        firsts = [experts.gate_up_proj]
        rest = [p for p in layer.parameters() if p is not experts.gate_up_proj]
        opts = [torch.optim.Adam(firsts, lr=1e-3), torch.optim.Adam(rest, lr=1e-3)]
    else:
        opts = [torch.optim.Adam(layer.parameters(), lr=1e-3)]
    orders, losses, held = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            for opt in opts:
                opt.zero_grad()
            loss = (layer(x_SH) ** 2).sum()
            loss.backward()
            for opt in opts:
                opt.step()
            orders.append(experts.home_order)
            decisions = experts.runtime.placer.decisions
            held.append(0 if decisions is None else decisions.residency.window.filled)
            losses.append(float(loss))
    full = gather_full_state_dict(layer)
    said = [str(w.message) for w in caught if "re-home" in str(w.message)]
    return {"orders": orders, "losses": losses, "said": said, "held": held,
            "move_bytes": layer.runtime.move_bytes,
            "weights": {k: v for k, v in full.items() if "experts" in k}}  # fmt: skip


STEPS = 12
CASES = [  # (options, split, rehomes)
    ({}, False, True),
    ({"transport": "a2a"}, False, True),
    ({"rehome": False}, False, False),
    ({}, True, False),  # an optimizer holds only some of the tensors: a warning
]


@pytest.mark.distributed
@pytest.mark.parametrize(("options", "split_opt", "rehomes"), CASES)
def test_auto_rehomes_in_training_after_an_optimizer_step_where_its_decisions_offer_it(
    options, split_opt, rehomes
) -> None:
    world, E, sizes = 2, 8, [12, 10]
    ids, wk = _hot_ids(sum(sizes), E, K, SEED)
    cfg = {"E": E, "sizes": sizes, "ids": ids, "w": wk, "options": options, "split": split_opt}
    got = run_ranks(_trained_auto, world, cfg, timeout=240)
    assert got[0]["orders"] == got[1]["orders"]  # every rank re-homes at the same step
    orders = got[0]["orders"]
    assert [len(g["said"]) for g in got] == [int(split_opt)] * world
    if split_opt:
        assert "holds only some of its expert tensors" in got[0]["said"][0]
    if not rehomes:
        assert set(orders) == {None}
        return
    assert got[0]["move_bytes"] == 4.0  # fp32 rows, gradients and Adam's two moments
    assert orders[0] is None and orders[-1] is not None  # re-homed after a step, kept
    want = popular_order(torch.bincount(ids.reshape(-1), minlength=E), world, list(range(E)))
    assert set(orders[-1][:4]) == set(want[:4])  # the hot expert's rank: the window's groups
    assert got[0]["held"] == list(range(1, STEPS + 1))  # a re-home keeps the window's loads
    plain = run_ranks(_trained_auto, world, {**cfg, "options": {**options, "rehome": False}},
                      timeout=240)  # fmt: skip
    for a, b in zip(plain, got, strict=True):  # trained on as without the moves
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-4)
        for key, want_w in a["weights"].items():
            torch.testing.assert_close(b["weights"][key], want_w, rtol=1e-4, atol=1e-5)


def test_an_optimizer_whose_state_cannot_follow_the_rows_warns_and_moves_nothing() -> None:
    """Adafactor keeps factored statistics (a row and a column vector per matrix): their
    rows cannot follow an expert's, so auto warns once and never re-homes in training."""
    from moonplan import MoonMoE
    from tests.plan.choice.costs import rows_only

    layer = MoonMoE(H, 12, 4, K, balance="auto", cost=rows_only(plan_s=1e-5), slots=1)
    opt = torch.optim.Adafactor(layer.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            layer(torch.randn(5, H)).sum().backward()
            opt.step()
    said = [str(w.message) for w in caught if "re-home" in str(w.message)]
    assert len(said) == 1 and "will not re-home this layer in training" in said[0]
    assert layer.runtime.move_bytes == 0.0 and layer.experts.home_order is None
    assert layer.experts not in watched()  # done: told of no more optimizer steps


def _mixed(rank: int, world: int, cfg: dict) -> str:
    """Adam steps of an auto layer whose optimizer holds every expert tensor on rank 0
    and only some of them on rank 1: the error each rank raises (``""``: none)."""
    from moonplan.comm.errors import ContractError
    from tests.plan.choice.costs import rows_only

    sizes, E = cfg["sizes"], cfg["E"]
    x_SH = split(tokens(sum(sizes), H, SEED), sizes)[rank]
    cost = rows_only(copy_s_intra=1e-6, copy_s_inter=1e-6, plan_s=1e-5)
    layer = _layer(E, cfg["ids"], cfg["w"], sum(sizes[:rank]), balance="auto", cost=cost,
                   slots=2)  # fmt: skip
    held = [p for p in layer.parameters() if rank == 0 or p is not layer.experts.down_proj]
    opt = torch.optim.Adam(held, lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank 1's warning: only some of its tensors
        try:
            for _ in range(3):
                opt.zero_grad()
                (layer(x_SH) ** 2).sum().backward()
                opt.step()
        except ContractError as exc:
            return str(exc)
    return ""


@pytest.mark.distributed
def test_ranks_whose_optimizers_differ_get_the_same_error_and_none_hangs() -> None:
    """The hook runs no collective: rank 0 notes 4 bytes per weight byte, rank 1 none
    (its optimizer holds only some tensors); the next step's exchange finds them
    different and every rank raises alike."""
    world, E, sizes = 2, 8, [12, 10]
    ids, wk = _hot_ids(sum(sizes), E, K, SEED)
    got = run_ranks(_mixed, world, {"E": E, "sizes": sizes, "ids": ids, "w": wk}, timeout=120)
    assert got[0] == got[1] != ""
    assert "rank 0: 4, rank 1: 0" in got[0], got[0]
