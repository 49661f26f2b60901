"""Refilling resident slots in the background (``LayerRuntime.request_refill``).

Legend: R ranks, E experts, B slots, S staging rows, T tokens (all ranks), H hidden, F ffn,
K top-k; ``slot_RB`` int64 ``[R, B]`` slot tables (``-1`` empty).

The host logic (which slots change, the slots after a commit, the agreed decision) is
checked on its own; the rest on real process groups: a refill requested and held in
flight for several steps (each rank's status held back a different number of steps, so
the commit waits for the slowest), then committed; every step's output and gradients
equal a dense fp64 oracle, the plans after the commit keep the refilled slots resident
without fetching them again, and a rerun gives the same bits. A copy that fails on one
rank makes every rank warn and drop it, with outputs and plans bit-identical to a layer
that never refilled; bad requests raise the same error on every rank.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from moonplan.runtime import refill as rf
from moonplan.runtime.transports.registry import builtin_name
from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_moe, dense_weights, split, tokens

H, F, K, TIMEOUT = 8, 12, 2, 120.0


# ---- host logic -------------------------------------------------------------------------


def _t(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def test_changed_slots_are_the_targets_that_differ() -> None:
    current = _t([[3, -1], [0, 1], [-1, -1]])
    target = _t([[3, 4], [-1, 2], [-1, -1]])
    assert rf.changed_slots(target, current) == [(1,), (1,), ()]


def test_a_commit_empties_another_slot_holding_a_refilled_expert() -> None:
    """Rank 0's slot 0 gets expert 5, which a step's plan meanwhile put in its slot 1:
    slot 1 is emptied, so no rank holds an expert twice; other slots stay."""
    current = _t([[2, 5, 7], [4, -1, 6]])
    target = _t([[5, -1, -1], [-1, 0, -1]])
    changed = rf.changed_slots(target, current)
    assert changed == [(0,), (1,)]
    got = rf.refilled_slots(current, target, changed)
    assert got.tolist() == [[5, -1, 7], [4, 0, 6]]


def test_every_rank_decides_alike_from_the_gathered_statuses() -> None:
    def rows(*codes: int, text: str = "") -> torch.Tensor:
        words = [[c, *rf._encode(text if c == rf.FAILED else "")] for c in codes]
        return torch.tensor(words, dtype=torch.int64)

    assert rf.agree(rows(rf.NONE, rf.NONE)) == ("none", "")
    assert rf.agree(rows(rf.DONE, rf.IN_FLIGHT)) == ("wait", "")
    assert rf.agree(rows(rf.DONE, rf.DONE)) == ("commit", "")
    decision, why = rf.agree(rows(rf.DONE, rf.FAILED, rf.IN_FLIGHT, text="OSError: disk"))
    assert decision == "drop" and why == "rank 1: OSError: disk"
    assert rf.agree(rows(rf.NONE, rf.DONE)) == ("drop", "rank 0: no refill")


def test_an_error_text_survives_the_exchange_truncated() -> None:
    long = "é" * 100  # 200 bytes of UTF-8: cut to TEXT_BYTES, never mid-character
    words = torch.tensor([rf.FAILED, *rf._encode(long)], dtype=torch.int64)
    assert words.numel() == rf.STATUS_WORDS
    assert rf._decode(words[1:].numpy()) == "é" * (rf.TEXT_BYTES // 2)


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (_t([[1, -1]]), r"must be \[R=2, B=2\]"),
        (torch.zeros(2, 2), "integer tensor"),
        ([[1, -1], [-1, -1]], "integer tensor"),
        (_t([[-2, -1], [-1, -1]]), "-1"),
        (_t([[2, 2], [-1, -1]]), "twice"),
        (_t([[0, -1], [-1, -1]]), "own home experts"),
        (_t([[9, -1], [-1, -1]]), "outside"),
        (_t([[2, 3], [0, -1]]), r"more slots than the 1 staging rows .* on rank 0: 2"),
    ],
)
def test_bad_targets_are_refused(target: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):  # PlanError is a ValueError
        rf.check_target(target, _t([[-1, -1], [-1, -1]]), num_experts=4, staging_rows=1)


# ---- distributed ------------------------------------------------------------------------


def _routing(T: int, E: int, seed: int, hot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids ``[T, K]`` (a third of the tokens on expert ``hot``) and weights ``[T, K]``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    first = ids[:, 0].clone()
    ids[: T // 3, 0] = hot
    ids[: T // 3, 1] = torch.where(ids[: T // 3, 1] == hot, first[: T // 3], ids[: T // 3, 1])
    ids[: T // 3, 1] = torch.where(ids[: T // 3, 1] == hot, (hot + 1) % E, ids[: T // 3, 1])
    return ids, torch.softmax(torch.randn(T, K, generator=g), -1)


def _counts(ids_TK: torch.Tensor, sizes: list[int], E: int) -> torch.Tensor:
    parts = split(ids_TK, sizes)
    return torch.stack([torch.bincount(p.reshape(-1), minlength=E) for p in parts])


def _oracle(cfg: dict, w: dict, ids: torch.Tensor, wk: torch.Tensor) -> dict:
    """fp64 output and gradients of the whole batch (the cotangent fixed by the seed)."""
    T = sum(cfg["sizes"])
    x = tokens(T, H, 5).double().requires_grad_(True)
    ws = {n: w[n].double().requires_grad_(True) for n in ("gate_up", "down")}
    y = dense_moe(x, ids, wk, ws)
    c = torch.randn(T, H, generator=torch.Generator().manual_seed(9)).double()
    (y * c).sum().backward()
    return {"y": y.detach(), "x": x.grad, "gate_up": ws["gate_up"].grad, "down": ws["down"].grad}


def _layer(cfg: dict, rank: int, holder: dict, w: dict):
    from moonplan import MoonMoE

    offset = sum(cfg["sizes"][:rank])

    def route(x_SH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, wk = holder["routing"]
        n = x_SH.shape[0]
        return ids[offset : offset + n], wk[offset : offset + n] * (1 + 0 * x_SH.sum())

    layer = MoonMoE(
        H, F, cfg["E"], K, slots=cfg.get("slots", 2), router=route, balance="exact",
        transport=cfg["transport"], overlap=cfg.get("overlap", True), max_tokens=64,
    )  # fmt: skip
    layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
    return layer


def _step(layer, rank: int, cfg: dict) -> dict:
    """One forward and backward on this rank's tokens: outputs, gradients, the plan."""
    T = sum(cfg["sizes"])
    x = split(tokens(T, H, 5), cfg["sizes"])[rank].clone().requires_grad_(True)
    c = split(torch.randn(T, H, generator=torch.Generator().manual_seed(9)), cfg["sizes"])[rank]
    layer.zero_grad()
    y = layer(x)
    (y * c).sum().backward()
    plan = layer.last_plan
    return {
        "y": y.detach(), "x": x.grad, "gate_up": layer.gate_up.grad.clone(),
        "down": layer.down.grad.clone(), "slots": plan.slot_expert.clone(),
        "new": plan.slot_new.clone(), "rows": plan.row_count.clone(),
    }  # fmt: skip


def _target(layer, counts_RE: torch.Tensor, S: int, *, elsewhere: bool = False) -> torch.Tensor:
    """The slots an exact plan of ``counts`` wants, at most ``S`` changes per rank.
    ``elsewhere``: instead, for each rank, the first new slot's expert of the plan the
    next step will make from ``counts``, in the next slot over (where that plan will not
    put it)."""
    from moonplan.plan.api import plan

    current = layer.runtime.resident.slot_expert
    target = torch.full_like(current, -1)
    if elsewhere:
        step = plan(counts_RE, slots=layer.slots, previous=layer.runtime.resident)
        for r, slots in enumerate(step.slot_new.tolist()):
            new = [j for j, n in enumerate(slots) if n]
            if new:
                target[r, (new[0] + 1) % len(slots)] = step.slot_expert[r, new[0]]
        return target
    want = plan(counts_RE, slots=layer.slots).slot_expert
    for r, slots in enumerate(rf.changed_slots(want, current)):
        for j in slots[:S]:
            target[r, j] = want[r, j]
    return target


def _copied(runtime) -> None:
    """Wait until this rank's refill copy has ended (so the next step sees it ended)."""
    if runtime.refill.in_flight:
        runtime.refill._job.pending.wait()


def _hold(runtime, steps: int) -> None:
    """Report this rank's refill as in flight for ``steps`` more exchanges once its copy
    has ended (waited for here, so that the step of the commit is the same every run:
    ``test_a_slow_copy_runs_beside_the_steps`` lets a real copy run)."""
    real = runtime.refill.status_words
    left = [steps]

    def held(device: torch.device) -> torch.Tensor:
        _copied(runtime)
        words = real(device)
        if left[0] > 0 and int(words[0]) == rf.DONE:
            left[0] -= 1
            words[0] = rf.IN_FLIGHT
        return words

    runtime.refill.status_words = held


def _scenario(rank: int, world: int, cfg: dict) -> dict:
    """Two steps on routing A, a refill towards routing B's plan requested and held in
    flight for ``rank + 1`` steps (on routing A), then steps on routing B."""
    E, sizes = cfg["E"], cfg["sizes"]
    w = dense_weights(E, H, F, seed=3)
    routes = {"A": _routing(sum(sizes), E, 1, hot=0), "B": _routing(sum(sizes), E, 2, hot=E - 1)}
    holder = {"routing": routes["A"]}
    layer = _layer(cfg, rank, holder, w)
    rt = layer.runtime
    out: dict = {"steps": [], "home": layer.home_range}
    for _ in range(2):
        out["steps"].append(("A", _step(layer, rank, cfg), rt.refill.commits))
    counts_B = _counts(routes["B"][0], sizes, E)
    target = _target(layer, counts_B, rt.S, elsewhere=cfg.get("elsewhere", False))
    out["target"], out["before"] = target, rt.resident.slot_expert.clone()
    rt.request_refill(target)
    out["in_flight"] = rt.refill.in_flight
    _hold(rt, rank + 1)
    for name in [cfg.get("hold_on", "A")] * world + ["B"] * 3:
        holder["routing"] = routes[name]
        out["steps"].append((name, _step(layer, rank, cfg), rt.refill.commits))
    out["drops"] = rt.refill.drops
    rt.close()
    return out


def _check_oracle(got: list[dict], cfg: dict) -> None:
    E = cfg["E"]
    w = dense_weights(E, H, F, seed=3)
    T = sum(cfg["sizes"])
    want = {
        n: _oracle(cfg, w, *_routing(T, E, s, hot)) for n, s, hot in (("A", 1, 0), ("B", 2, E - 1))
    }
    for r, res in enumerate(got):
        lo, hi = res["home"]
        for name, step, _ in res["steps"]:
            ref = want[name]
            for key, mine, theirs in (
                ("y", step["y"], split(ref["y"], cfg["sizes"])[r]),
                ("x", step["x"], split(ref["x"], cfg["sizes"])[r]),
                ("gate_up", step["gate_up"], ref["gate_up"][lo:hi]),
                ("down", step["down"], ref["down"][lo:hi]),
            ):
                torch.testing.assert_close(mine.double(), theirs, rtol=1e-5, atol=1e-6, msg=key)


def _check_commit(got: list[dict], world: int, E: int) -> int:
    """The refill is in flight until the slowest rank is done (rank ``R - 1`` holds it
    ``R`` steps), then committed: the commit step's plan keeps each refilled slot and
    fetches none of them. Returns the records run on refilled slots at that step."""
    M, used = -(-E // world), 0
    for res in got:
        assert res["in_flight"] and res["drops"] == 0
        commits = [c for _, _, c in res["steps"]]
        assert commits == [0] * (2 + world) + [1] * 3  # the first step on routing B commits
        step, target = res["steps"][2 + world][1], res["target"]
        refilled = target >= 0
        assert torch.equal(step["slots"][refilled], target[refilled])
        assert not bool(step["new"][refilled].any())  # resident: not fetched again
        for row in step["slots"].tolist():  # no rank holds an expert twice
            held = [e for e in row if e >= 0]
            assert len(set(held)) == len(held)
        B = step["slots"].shape[1]
        used += int(step["rows"][:, M : M + B][refilled].sum())
    return used


CASES = [
    # world, E, transport, overlap; "heap" on CPU is the shm heap
    (2, 4, "heap", True),
    (2, 6, "a2a", True),
    (2, 6, "a2a", False),  # serial schedule: the copy runs inline, on the main group
    (4, 8, "heap", True),
    (4, 8, "a2a", True),
    (4, 8, builtin_name("heap", "tokens"), True),
    (3, 7, builtin_name("a2a", "records"), True),
    (4, 8, "a2a-hosts", True),
]


def _twice(rank: int, world: int, cfg: dict) -> list[dict]:
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # a2a-hosts: two simulated hosts (others ignore it)
    return [_scenario(rank, world, cfg) for _ in range(2)]


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "E", "transport", "overlap"), CASES)
def test_a_refill_in_flight_then_committed_equals_the_oracle(world, E, transport, overlap) -> None:
    sizes = [9, 6, 0, 8][:world] if world > 2 else [9, 7][:world]
    cfg = {"E": E, "sizes": sizes, "transport": transport, "overlap": overlap}
    runs = run_ranks(_twice, world, cfg, timeout=TIMEOUT)
    first = [r[0] for r in runs]
    _check_oracle(first, cfg)
    assert sum(int((r["target"] >= 0).sum()) for r in first[:1]) > 0  # slots do change
    assert _check_commit(first, world, E) > 0  # records ran on refilled slots
    for r in runs:  # a rerun gives the same bits
        for (_, a, _), (_, b, _) in zip(r[0]["steps"], r[1]["steps"], strict=True):
            for key in a:
                assert torch.equal(a[key], b[key]), key


def test_a_commit_empties_the_slot_a_step_filled_with_the_same_expert() -> None:
    """The target puts routing B's new replica of each rank one slot over from where the
    steps on routing B fetch it while the refill is held; the commit puts it in the
    target's slot and empties the other (no rank holds an expert twice), outputs exact."""
    world, E = 4, 8
    cfg = {"E": E, "sizes": [9, 6, 0, 8], "transport": "heap", "hold_on": "B", "elsewhere": True}
    got = run_ranks(_scenario, world, cfg, timeout=TIMEOUT)
    _check_oracle(got, cfg)
    _check_commit(got, world, E)
    moved = 0
    for res in got:
        target, before = res["target"], res["steps"][1 + world][1]["slots"]
        after = res["steps"][2 + world][1]["slots"]
        for r, j in (target >= 0).nonzero().tolist():
            e = int(target[r, j])
            if e in before[r].tolist() and int(before[r, j]) != e:  # a step put it elsewhere
                assert after[r].tolist().count(e) == 1 and int(after[r, j]) == e
                moved += 1
    assert moved > 0  # the case happened


def _faulty(rank: int, world: int, cfg: dict) -> dict:
    """A refill whose copy raises on the first rank it changes a slot of, beside a layer
    that never refills; then the same refill again with the copy fixed."""
    E, sizes = cfg["E"], cfg["sizes"]
    w = dense_weights(E, H, F, seed=3)
    routes = {"A": _routing(sum(sizes), E, 1, hot=0), "B": _routing(sum(sizes), E, 2, hot=E - 1)}
    holders = [{"routing": routes["A"]}, {"routing": routes["A"]}]
    layers = [_layer(cfg, rank, h, w) for h in holders]  # [refilled, control]
    rt = layers[0].runtime
    out: dict = {"steps": [], "home": layers[0].home_range, "warnings": []}

    def step(name: str) -> None:
        got = []
        for layer, holder in zip(layers, holders, strict=True):
            holder["routing"] = routes[name]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got.append(_step(layer, rank, cfg))
            out["warnings"] += [str(c.message) for c in caught if c.category is RuntimeWarning]
        out["steps"].append((name, got[0], rt.refill.commits))
        out.setdefault("control", []).append(got[1])

    def broken(name: str, rows: torch.Tensor) -> None:
        raise OSError("injected copy fault")

    step("A")
    good = rt.store._put_staged
    target = _target(layers[0], _counts(routes["B"][0], sizes, E), rt.S)
    out["bad"] = min(r for r in range(world) if bool((target[r] >= 0).any()))
    if rank == out["bad"]:
        rt.store._put_staged = broken
    rt.request_refill(target)
    _copied(rt)
    for name in "AAA":
        step(name)
    out["dropped"] = (rt.refill.drops, rt.refill.in_flight)
    rt.store._put_staged = good
    rt.request_refill(target)
    _copied(rt)
    for name in "BB":
        step(name)
    out["commits"] = rt.refill.commits
    for layer in layers:
        layer.runtime.close()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world", "E", "transport"), [(2, 6, "heap"), (2, 6, "a2a"), (4, 8, "a2a")]
)
def test_a_copy_that_fails_on_one_rank_is_dropped_everywhere(world, E, transport) -> None:
    sizes = [9, 6, 0, 8][:world] if world > 2 else [9, 7]
    cfg = {"E": E, "sizes": sizes, "transport": transport}
    got = run_ranks(_faulty, world, cfg, timeout=TIMEOUT)
    _check_oracle(got, cfg)
    for res in got:
        (message,) = res["warnings"]  # once, on every rank, naming the rank and the error
        assert "refill dropped on every rank" in message
        assert f"rank {res['bad']}: OSError: injected copy fault" in message
        assert res["dropped"] == (1, False)
        # until the second refill's commit, the same plans and bits as a layer that
        # never refilled: the old slots kept serving
        for (_, mine, _), theirs in list(zip(res["steps"], res["control"], strict=True))[:4]:
            for key in mine:
                assert torch.equal(mine[key], theirs[key]), key
        assert res["commits"] == 1  # a later refill still works
        assert [c for _, _, c in res["steps"]] == [0, 0, 0, 0, 1, 1]


def _requests(rank: int, world: int) -> list[tuple[str, str]]:
    """Each bad request's error (type, message) on this rank, then a good one."""
    from moonplan import MoonMoE

    E = 6
    # off: no step's plan fills a slot, so each target changes exactly what it names
    layer = MoonMoE(H, F, E, K, slots=2, transport="heap", balance="off")
    got = []

    def attempt(target: Any) -> None:
        try:
            layer.runtime.request_refill(target)
            got.append(("", ""))
        except Exception as exc:
            got.append((type(exc).__name__, str(exc)))

    attempt(torch.full((world, 2), -1))  # before any step: no published home rows
    layer(torch.randn(5, H))
    for target in (
        torch.full((world, 3), -1),  # wrong shape
        torch.full((world, 2), -1.0),  # not integers
        torch.tensor([[3, 4], [0, 1]]),  # two changes on each rank, S = 1
        torch.tensor([[0, -1], [-1, -1]]),  # rank 0's own home expert
        torch.tensor([[3, -1], [-1, -1]]) if rank == 0 else torch.tensor([[4, -1], [-1, -1]]),
        torch.tensor([[-1, -1], [9, -1]]) if rank == 1 else torch.tensor([[4, -1], [-1, -1]]),
        torch.tensor([[3, -1], [-1, -1]]),  # good
        torch.tensor([[4, -1], [-1, -1]]),  # while the first is in flight
    ):
        attempt(target)
    _copied(layer.runtime)
    layer(torch.randn(5, H))  # commits the good one
    slot = int(layer.runtime.resident.slot_expert[0, 0])
    got.append((str(layer.runtime.refill.commits), str(slot)))
    layer.runtime.close()
    return got


@pytest.mark.distributed
def test_bad_requests_raise_the_same_error_on_every_rank() -> None:
    got = run_ranks(_requests, 2, timeout=TIMEOUT)
    assert got[0] == got[1]
    errors = got[0]
    assert errors[0][0] == "RuntimeError" and "run a step first" in errors[0][1]
    assert errors[1][0] == "ValueError" and "must be [R=2, B=2]" in errors[1][1]
    assert errors[2][0] == "ValueError" and "integer tensor" in errors[2][1]
    assert errors[3][0] == "ValueError" and "on rank 0: 2; rank 1: 2" in errors[3][1]
    assert errors[4][0] == "PlanError" and "own home experts" in errors[4][1]
    assert errors[5][0] == "ContractError" and "refill target" in errors[5][1]  # differ
    assert errors[6][0] == "ContractError" and "rank 1: PlanError" in errors[6][1]
    assert errors[7] == ("", "")
    assert errors[8][0] == "RuntimeError" and "already in flight" in errors[8][1]
    assert errors[9] == ("1", "3")


def _slow(rank: int, world: int) -> dict:
    """Inference steps while a real copy sleeps (no step starts a background job: the
    routing is fixed, every replica resident), until the refill commits."""
    import time

    E, sizes = 6, [9, 7]
    w = dense_weights(E, H, F, seed=3)
    routes = {"A": _routing(sum(sizes), E, 1, hot=0), "B": _routing(sum(sizes), E, 2, hot=E - 1)}
    holder = {"routing": routes["A"]}
    layer = _layer({"E": E, "sizes": sizes, "transport": "heap"}, rank, holder, w)
    rt = layer.runtime
    x = split(tokens(sum(sizes), H, 5), sizes)[rank]
    with torch.no_grad():
        first = [layer(x) for _ in range(2)][-1]
        put = rt.store._put_staged

        def slow(name: str, rows: torch.Tensor) -> None:
            time.sleep(0.5)  # on each rank that copies something
            put(name, rows)

        rt.store._put_staged = slow
        rt.request_refill(_target(layer, _counts(routes["B"][0], sizes, E), rt.S))
        t0, waiting, same = time.perf_counter(), 0, True
        while rt.refill.commits == 0 and time.perf_counter() - t0 < 30:
            y = layer(x)
            if rt.refill.commits == 0:  # old slots, same plan: the same bits
                same &= bool(torch.equal(y, first))
                waiting += 1
    layer.runtime.close()
    return {"waiting": waiting, "commits": rt.refill.commits, "same": same}


@pytest.mark.distributed
def test_a_slow_copy_runs_beside_the_steps() -> None:
    got = run_ranks(_slow, 2, timeout=TIMEOUT)
    assert got[0] == got[1] or got[0]["waiting"] == got[1]["waiting"]
    for res in got:
        assert res["commits"] == 1 and res["same"]
        assert res["waiting"] >= 1  # steps ran while the copy was under way


def _stale(rank: int, world: int, transport: str) -> dict:
    """A refill in flight when the weights change is dropped without a warning."""
    E, sizes = 6, [9, 7]
    w = dense_weights(E, H, F, seed=3)
    routes = {"A": _routing(sum(sizes), E, 1, hot=0), "B": _routing(sum(sizes), E, 2, hot=E - 1)}
    holder = {"routing": routes["A"]}
    cfg = {"E": E, "sizes": sizes, "transport": transport}
    layer = _layer(cfg, rank, holder, w)
    rt = layer.runtime
    out: dict = {"steps": [("A", _step(layer, rank, cfg), 0)], "home": layer.home_range}
    rt.request_refill(_target(layer, _counts(routes["B"][0], sizes, E), rt.S))
    _copied(rt)  # the copy is done: only the weights stop it
    if rank == 0:
        rt.weights_changed()  # one rank is enough: the counts exchange tells every rank
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out["steps"].append(("A", _step(layer, rank, cfg), rt.refill.commits))
    out["state"] = (rt.refill.drops, rt.refill.commits, rt.refill.in_flight)
    rt.close()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("transport", ["heap", "a2a"])
def test_changed_weights_drop_a_refill_in_flight(transport: str) -> None:
    got = run_ranks(_stale, 2, transport, timeout=TIMEOUT)
    _check_oracle(got, {"E": 6, "sizes": [9, 7]})
    assert [r["state"] for r in got] == [(1, 0, False)] * 2


def _alone(rank: int, world: int) -> tuple:
    """One rank holds every expert: no slot can hold a replica, a refill changes nothing."""
    from moonplan import MoonMoE

    layer = MoonMoE(H, F, 4, K, slots=2, balance="exact")
    layer(torch.randn(5, H))
    layer.runtime.request_refill(torch.full((1, 2), -1))
    started = layer.runtime.refill.in_flight
    try:
        layer.runtime.request_refill(torch.tensor([[1, -1]]))
        error = ""
    except ValueError as exc:
        error = str(exc)
    layer.runtime.close()
    return started, error


@pytest.mark.distributed
def test_one_rank_has_nothing_to_refill() -> None:
    ((started, error),) = run_ranks(_alone, 1, timeout=TIMEOUT)
    assert not started and "own home experts" in error


def _two_layers(rank: int, world: int) -> dict:
    """Two layers of the same shapes share one set of staging rows: while the first
    layer's refill holds them, the second's request by hand is refused alike on every rank
    (an order of its placer would wait in line: test_placer.py); after the first commits,
    the second refills too."""
    E, sizes = 6, [9, 7]
    w = dense_weights(E, H, F, seed=3)
    routes = {"A": _routing(sum(sizes), E, 1, hot=0), "B": _routing(sum(sizes), E, 2, hot=E - 1)}
    holder = {"routing": routes["A"]}
    cfg = {"E": E, "sizes": sizes, "transport": "a2a"}
    first, second = (_layer(cfg, rank, holder, w) for _ in range(2))
    a, b = first.runtime, second.runtime
    out: dict = {"shared": a.store.pool is b.store.pool}
    for layer in (first, second):
        _step(layer, rank, cfg)
    want = _counts(routes["B"][0], sizes, E)
    a.request_refill(_target(first, want, a.S))
    out["busy"] = (b.store.pool.held_by_other(b.refill), a.store.pool.held_by_other(a.refill))
    try:
        b.request_refill(_target(second, want, b.S))
        out["refused"] = ""
    except RuntimeError as exc:
        out["refused"] = str(exc)
    _copied(a)
    _step(first, rank, cfg)  # the first layer commits and gives the rows back
    out["after"] = (a.refill.commits, b.store.pool.held_by_other(b.refill))
    b.request_refill(_target(second, want, b.S))
    _copied(b)
    _step(second, rank, cfg)
    out["commits"] = (a.refill.commits, b.refill.commits)
    a.close()
    b.close()
    return out


@pytest.mark.distributed
def test_layers_take_turns_with_the_shared_staging_rows() -> None:
    first, second = run_ranks(_two_layers, 2, timeout=TIMEOUT)
    assert first == second  # every rank alike, the refusal included
    assert "another layer's refill holds the shared staging rows" in first.pop("refused")
    assert first == {"shared": True, "busy": (True, False), "after": (1, False),
                     "commits": (1, 1)}  # fmt: skip
