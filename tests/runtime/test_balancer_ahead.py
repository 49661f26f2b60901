"""``balance="auto"`` choosing ahead in the runtime (``moonplan.runtime.balancer``).

Legend: R ranks, E experts, K top-k, H hidden, F ffn, ``counts_RE`` int64 ``[R, E]``.

The balancer's threaded schedule against the in-caller reference
(:class:`moonplan.plan.ahead.AheadChoice`), the same candidate on every rank of a real
process group, the thread's life cycle, a failing search, calibration, the option and
the profile's figures.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from moonplan.comm.errors import ContractError
from moonplan.plan import plan
from moonplan.plan.ahead import AheadChoice
from moonplan.runtime.balancer import WARMUP_STEPS, Balancer, default_choose
from moonplan.runtime.config import MoEConfig
from moonplan.stepcost import StepCost
from moonplan.testing.dist import run_ranks

THREAD = "moonplan-choose"


def _cost(copy_s: float = 1e-4) -> StepCost:
    """Rows cost 1 us, an expert copy ``copy_s``; the rest is free. At these sizes the
    choice moves between exact, greedy, bounded, resident and static step to step."""
    return StepCost(1e-6, 0.0, 0.0, copy_s, copy_s, 0.0, 0.0, 0.0, 0.0)


def _trace(steps: int, R: int, E: int, seed: int) -> list[torch.Tensor]:
    """``steps`` count matrices ``[R, E]``: skewed, drifting, and a few adversarial ones
    (no records at all, every record on one expert, one rank with nothing)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        pop_E = torch.rand(E, generator=g) ** 4 + 0.01
        ids = torch.multinomial(pop_E, R * 64, replacement=True, generator=g).reshape(R, 64)
        counts = torch.stack([torch.bincount(row, minlength=E) for row in ids])
        if t % 7 == 3:
            counts = torch.zeros(R, E, dtype=torch.int64)
        elif t % 7 == 5:
            counts = torch.zeros(R, E, dtype=torch.int64)
            counts[:, E - 1] = 64
        elif t % 7 == 6:
            counts[0] = 0
        out.append(counts)
    return out


@pytest.mark.parametrize(("R", "E", "seed"), [(2, 5, 0), (4, 16, 1), (8, 32, 2)])
@pytest.mark.parametrize("search_s", [0.0, 6e-4])  # L = 1; searches longer than a step
def test_threaded_schedule_equals_the_in_caller_reference(
    R: int, E: int, seed: int, search_s: float
) -> None:
    """Every step's plan equals the reference's: ``AheadChoice.update`` run in the caller,
    with the same lag; the balancer waits only at the steps its searches name."""
    cost, B = _cost(), 2
    bal = Balancer("auto", slots=B, align=1, cost=cost, search_s=search_s)
    ref, prev_ref, prev = AheadChoice(search_s=search_s), None, None
    hows, pols, waits, lags = [], [], [], []
    try:
        for counts in _trace(12, R, E, seed):
            due = bal.ahead.due()
            assert bal.collect() == ""
            waits.append(bool(bal.figures))
            assert waits[-1] == due
            p = bal.plan(counts, prev)
            bal.search()
            want = plan(counts, slots=B, previous=prev_ref, policy=ref.policy(), cost=cost)
            if ref.update(counts, want, previous=prev_ref, cost=cost, slots=B) is not None:
                lags.append(ref.last_lag)
            assert p.policy == want.policy
            assert torch.equal(p.alloc, want.alloc) and torch.equal(p.slot_new, want.slot_new)
            hows.append(bal.how)
            pols.append(p.policy)
            prev, prev_ref = p, want
        assert hows == ["inline"] + ["ahead"] * 11
        if search_s == 0:  # a search after every step but the inline first, each waited for
            assert len(set(pols)) >= 3, pols  # the choice really moves
            assert lags == [1] * 11 and waits == [False, False] + [True] * 10
            assert set(bal.figures) == {"choice", "choice_exposed"}
            assert all(v >= 0 for v in bal.figures.values())
        else:
            assert max(lags) > 1 and sum(waits) == len(lags) - bal.ahead.searching
    finally:
        bal.close()


def test_inline_searches_every_step_and_other_modes_never() -> None:
    counts = _trace(1, 4, 16, 3)[0]
    bal = Balancer("auto", slots=2, align=1, cost=_cost(), choose="inline")
    for _ in range(3):
        assert bal.collect() == ""
        p = bal.plan(counts, None)
        bal.search()
        assert bal.how == "inline" and p.chose > 0 and bal.figures == {}
        assert bal._search is None
    for mode in ("exact", "off"):
        bal = Balancer(mode, slots=2, align=1, cost=_cost())
        bal.plan(counts, None)
        bal.search()
        assert bal.how == "none" and bal._search is None


def test_choose_option_is_validated_and_passed_through() -> None:
    from moonplan import MoonMoE

    assert MoEConfig().choose is None  # the layer picks by its device
    for bad in ("later", "Ahead", 1):
        with pytest.raises(ValueError, match="choose must be one of"):
            MoEConfig(choose=bad)  # type: ignore[arg-type]
    assert MoEConfig.merged(None, choose="inline").choose == "inline"
    assert MoonMoE(8, 8, 4, 2, choose="ahead").runtime.balancer.choose == "ahead"
    assert MoonMoE(8, 8, 4, 2, choose="inline").runtime.balancer.choose == "inline"


def test_the_default_is_ahead_on_an_accelerator_and_inline_on_the_cpu() -> None:
    """Measured on the CPU, the search in a thread shares the step's cores and GIL and is
    slower than inline (docs/runtime.md); on an accelerator the host thread runs beside it."""
    from moonplan import MoonMoE

    assert default_choose(torch.device("cpu")) == "inline"
    assert default_choose(torch.device("cuda", 0)) == "ahead"
    assert MoonMoE(8, 8, 4, 2).runtime.balancer.choose == "inline"  # a CPU layer


def _alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD)]


def test_the_thread_is_joined_on_close() -> None:
    from moonplan import MoonMoE

    before = set(_alive())  # other layers of this process may hold theirs
    layer = MoonMoE(8, 8, 4, 2, cost=_cost(), choose="ahead")
    with torch.no_grad():
        for _ in range(3):
            layer(torch.randn(16, 8))
    assert layer.last_stats is not None and layer.last_stats.choice == "ahead"
    (mine,) = set(_alive()) - before
    layer.runtime.close()
    assert not mine.is_alive()


def test_calibration_resets_the_choice() -> None:
    """A new cost model (calibrated, or on demand): the next step searches inline with it."""
    from moonplan import MoonMoE

    layer = MoonMoE(8, 8, 4, 2, choose="ahead")
    choices = []
    with torch.no_grad():
        for _ in range(WARMUP_STEPS + 3):
            layer(torch.randn(32, 8))
            choices.append(layer.last_stats.choice)
        layer.calibrate()
        for _ in range(2):
            layer(torch.randn(32, 8))
            choices.append(layer.last_stats.choice)
    warm = ["none"] * (WARMUP_STEPS + 1)
    assert choices == [*warm, "inline", "ahead", "inline", "ahead"]
    layer.runtime.close()


# ---- real process groups -------------------------------------------------------------------
def _drifting_router(E: int, K: int, rank: int):
    """Top-``K`` of skewed logits drifting with the step (the same law on every rank)."""
    state = {"step": 0}

    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * state["step"] + rank)
        bias = 3.0 * torch.randn(E, generator=torch.Generator().manual_seed(state["step"] // 2))
        logits = torch.randn(x.shape[0], E, generator=g) + bias
        w, ids = torch.softmax(logits, -1).topk(K, -1)
        state["step"] += 1
        return ids, w * (1 + 0 * x.sum())

    return route


COPY_S = 1e-4


def oracle_layer(rank: int, search_us: float) -> tuple[Any, Any]:
    """A choose-ahead layer (``E = 12``, ``K = 2``, ``H = F = 8``) on the drifting router
    with oracle weights; ``run(x)`` returns ``(y, error)``: the step's output and its
    largest difference from the dense oracle."""
    from moonplan import MoonMoE
    from tests.runtime.oracle import dense_moe, dense_weights

    E, K = 12, 2
    route = _drifting_router(E, K, rank)
    routed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def router(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, w = route(x)
        routed.append((ids, w.detach()))
        return ids, w

    layer = MoonMoE(8, 8, E, K, cost=_cost(COPY_S), router=router, choose="ahead",
                    search_us=search_us)  # fmt: skip
    w = dense_weights(E, 8, 8, seed=3)
    layer.load_dense(w["router_weight"], w["gate_up"], w["down"])

    def run(x: torch.Tensor) -> tuple[torch.Tensor, float]:
        y = layer(x)
        ids, wk = routed[-1]
        return y, float((y.double() - dense_moe(x, ids, wk, w)).abs().max())

    return layer, run


def _choices(rank: int, world: int, steps: int, search_us: float) -> dict[str, Any]:
    layer, run = oracle_layer(rank, search_us)
    cost, rt = _cost(COPY_S), layer.runtime
    plans, hows, phases, errors = [], [], [], []
    with torch.no_grad():
        for _ in range(steps):
            x = torch.randn(24, 8, generator=torch.Generator().manual_seed(rank))
            errors.append(run(x)[1])
            plans.append(rt.last_plan)
            hows.append(layer.last_stats.choice)
            phases.append(dict(layer.last_stats.phases))
    # Each step built what the in-caller schedule names (AheadChoice with the same lag:
    # the search on step t's counts from plan_{t-1}, with the basis of the search that
    # named it, in force from step t + L)
    ref, named, lags = AheadChoice(search_s=search_us * 1e-6), [], []
    for t, p in enumerate(plans[:-1]):
        prev = plans[t - 1] if t else None
        if ref.update(p.counts, p, previous=prev, cost=cost, slots=rt.B) is not None:
            lags.append(ref.last_lag)
        named.append(ref.policy())
    rt.close()
    return {
        "policies": [p.policy for p in plans],
        "named": named,
        "lags": lags,
        "alloc": [p.alloc for p in plans],
        "hows": hows,
        "phases": phases,
        "errors": errors,
    }


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "search_us"), [(2, 0.0), (3, 0.0), (4, 0.0), (2, 600.0),
                                                  (4, 600.0)])  # fmt: skip
def test_every_rank_builds_the_same_named_candidate(world: int, search_us: float) -> None:
    """Every rank builds the same candidate each step, named by the in-caller schedule,
    and waits at the same steps; with the default ``search_us`` and steps this cheap the
    searches name steps more than one ahead; the outputs equal the dense oracle."""
    steps = 10
    got = run_ranks(_choices, world, steps, search_us, timeout=240)
    first = got[0]
    assert first["hows"] == ["inline"] + ["ahead"] * (steps - 1)
    assert first["policies"][1:] == first["named"]
    assert len(set(first["policies"])) >= 2, first["policies"]  # the choice really moves
    waited = ["choice" in ph for ph in first["phases"]]
    assert not waited[0] and not waited[1]  # the inline step's search was its own
    if search_us == 0:
        assert first["lags"] == [1] * (steps - 2) and all(waited[2:])
    else:
        assert max(first["lags"]) > 1 and 0 < sum(waited) < steps - 2
    for g in got:
        assert g["policies"] == first["policies"] and g["named"] == first["named"]
        assert all(torch.equal(a, b) for a, b in zip(g["alloc"], first["alloc"], strict=True))
        assert ["choice" in ph for ph in g["phases"]] == waited
        for ph in g["phases"]:  # the wait and the search's own time, both measured
            assert "choice" not in ph or (ph["choice"] > 0 and ph["choice_exposed"] >= 0)
        assert max(g["errors"]) < 1e-4


def _failing(rank: int, world: int, bad: list[int]) -> dict[str, Any]:
    import moonplan.runtime.balancer as balancer_module
    from moonplan import MoonMoE

    calls = {"n": 0}
    real = balancer_module.choose_next

    def search(*args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1 and rank in bad:  # the search submitted by step 1 (the first:
            # none follows the inline step 0)
            raise RuntimeError("boom in the search")
        return real(*args, **kw)

    balancer_module.choose_next = search  # this forked rank's module only
    layer = MoonMoE(8, 8, 6, 2, cost=_cost(), choose="ahead", search_us=0.0)  # L = 1
    hows, errors = [], []
    with torch.no_grad():
        for _ in range(5):
            try:
                layer(torch.randn(12, 8))
                hows.append(layer.last_stats.choice)
            except ContractError as exc:
                errors.append((str(exc), exc.ranks))
                hows.append("failed")
    alive = bool(_alive())
    layer.runtime.close()
    return {"hows": hows, "errors": errors, "alive_before_close": alive}


@pytest.mark.distributed
@pytest.mark.parametrize("bad", [[1], [0, 1, 2]])
def test_a_failing_search_raises_the_same_error_on_every_rank(bad: list[int]) -> None:
    """Step 2 waits for step 1's search: every rank raises ContractError naming the
    failing ranks (no hang); step 3 searches inline on every rank, step 4 is named."""
    got = run_ranks(_failing, 3, bad, timeout=120)
    for g in got:
        assert g["hows"] == ["inline", "ahead", "failed", "inline", "ahead"]
        ((msg, ranks),) = g["errors"]
        assert ranks == tuple(bad)
        assert "choosing ahead failed: RuntimeError: boom in the search" in msg
        assert g["errors"] == got[0]["errors"]


def test_the_profile_shows_the_choice_and_its_wait() -> None:
    from moonplan import MoonMoE
    from moonplan.profiling.phases import BACKGROUND_PHASES, CHOICE_PHASES
    from moonplan.profiling.session import profiling

    layer = MoonMoE(16, 16, 4, 2, cost=_cost(), choose="ahead", search_us=0.0)  # L = 1
    x = torch.randn(32, 16)
    with torch.no_grad():
        layer(x)
        with profiling(layer) as prof:
            for _ in range(3):
                layer(x)
    report = prof.report
    assert set(CHOICE_PHASES) <= set(report.present) and "choice" in BACKGROUND_PHASES
    d = report.rank_phase_s()[0, -1]
    for name in CHOICE_PHASES:  # the spans are the step's own figures
        seconds = layer.last_stats.phases[name]
        assert d[report.phases.index(name)] == pytest.approx(seconds, rel=1e-9, abs=1e-12)
    assert "choice: " in report.table() and "in the background" in report.table()
    # the search was submitted by the previous step: it starts before this step's wait
    # for it ends (the thread may only get a core once the step blocks in that wait,
    # which choice_exposed then counts: nothing is hidden)
    spans = [s for s in report.spans if report.phases[s.phase] == "choice" and s.step == 2]
    (wait,) = [s for s in report.spans if report.phases[s.phase] == "choice_exposed"
               and s.step == 2]  # fmt: skip
    starts = [s.start for s in report.spans if s.step == 2 and s.phase != spans[0].phase]
    assert spans and spans[0].start <= wait.end
    assert (
        report.wall_step_s()[2]
        <= max(s.end for s in report.spans if s.step == 2) - min(starts) + 1e-9
    )
    layer.runtime.close()


def test_the_search_thread_is_handed_host_copies_not_the_plans() -> None:
    """What the thread searches from is taken in ``plan()``: the counts and the previous
    plan's slots, flows, policy and basis, copied to the host (``Before``); its choice is
    the search on the plan itself. Steps a search in flight spans copy nothing."""
    from moonplan.plan.ahead import Before, choose_next

    cost, B = _cost(), 2
    bal = Balancer("auto", slots=B, align=1, cost=cost, search_s=6e-4)
    prev = None
    spanned = 0
    try:
        for counts in _trace(8, 4, 16, 5):
            assert bal.collect() == ""
            start = bal.ahead.start(prev)
            searching = bal.ahead.searching
            p = bal.plan(counts, prev)
            assert bal._made is not None
            host, before, made = bal._made
            assert made is p
            if searching:  # a search in flight spans this step: nothing to copy
                assert host is None and before is None
                spanned += 1
                bal.search()
                prev = p
                continue
            assert host is not None and torch.equal(host, counts) and host is not counts
            assert host.device.type == "cpu"
            if prev is None:
                assert before is None
            else:
                assert isinstance(before, Before) and start is not None
                assert before.slot_expert.device.type == before.flow.device.type == "cpu"
                assert torch.equal(before.slot_expert, start.slot_expert)
                assert (before.policy, before.basis) == (start.policy, start.basis)
                got = choose_next(host, before, cost=cost, slots=B)
                assert got == choose_next(counts, start, cost=cost, slots=B)
            bal.search()
            prev = p
    finally:
        bal.close()
    assert spanned > 0  # 600 us a construction against these tiny steps: lags above 1


def test_search_us_is_validated_and_handed_to_the_balancer() -> None:
    from moonplan import MoonMoE
    from moonplan.runtime.balancer import SEARCH_US

    assert MoEConfig().search_us == SEARCH_US == 600.0  # bench/bench_search.py's host figure
    for bad in (-1.0, float("inf"), float("nan"), "600", True, None):
        with pytest.raises(ValueError, match="search_us must be"):
            MoEConfig(search_us=bad)  # type: ignore[arg-type]
    assert MoEConfig(search_us=3).search_us == 3.0
    layer = MoonMoE(8, 8, 4, 2, choose="ahead", search_us=250.0)
    assert layer.runtime.balancer.ahead.search_s == pytest.approx(250e-6)
    layer.runtime.close()


def test_the_thread_searches_with_the_measured_horizon_and_the_lags_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each search the balancer submits scores with ``AheadChoice.search_cost``: the
    horizon measured on every plan recorded so far (this step's included), capped by
    the cost model's own. On this drifting trace the replicas do not serve 8 steps."""
    import moonplan.runtime.balancer as balancer_module
    from moonplan.plan.ahead import executed
    from moonplan.plan.reuse import ReplicaLife

    seen: list[float] = []
    budgets: list[object] = []
    real = balancer_module.choose_next

    def spy(*args: object, cost: StepCost, **kw: object) -> object:
        seen.append(cost.horizon)
        budgets.append(kw.get("budget"))
        return real(*args, cost=cost, **kw)

    monkeypatch.setattr(balancer_module, "choose_next", spy)
    cost = _cost(copy_s=2e-5)
    bal = Balancer("auto", slots=2, align=1, cost=cost, search_s=1e-9)  # always L = 1
    life, want, prev = ReplicaLife(), [], None
    wanted_budgets: list[object] = []
    try:
        for counts in _trace(10, 4, 16, 11):
            assert bal.collect() == ""
            searching = bal.ahead.searching
            p = bal.plan(counts, prev)
            life.observe(*executed(p))
            starts = not searching and bal.ahead.policy() != "auto"  # a search after it
            if starts:
                want.append(life.horizon(cost.horizon))
            bal.search()
            if starts:  # the budget of its lag (search_budget)
                wanted_budgets.append(bal.ahead.last_budget)
            bal._lane.drain()
            prev = p
    finally:
        bal.close()
    assert seen == want and len(seen) >= 5
    assert min(seen) < cost.horizon  # measured, not the cap
    assert budgets == wanted_budgets and any(b is not None for b in budgets)


def test_inline_auto_scores_with_the_horizon_measured_on_its_own_plans() -> None:
    """``choose="inline"``: each step's ``plan(policy="auto")`` gets the cost model with the
    horizon measured on the plans of the steps before (``search()`` records each)."""
    import dataclasses

    from moonplan.plan.ahead import executed
    from moonplan.plan.reuse import ReplicaLife

    cost = _cost(copy_s=2e-5)
    bal = Balancer("auto", slots=2, align=1, cost=cost, choose="inline")
    life, prev, horizons = ReplicaLife(), None, []
    try:
        for counts in _trace(10, 4, 16, 12):
            assert bal.collect() == ""
            measured = dataclasses.replace(cost, horizon=life.horizon(cost.horizon))
            want = plan(counts, slots=2, previous=prev, policy="auto", cost=measured)
            p = bal.plan(counts, prev)
            assert torch.equal(p.alloc, want.alloc) and p.policy == want.policy
            bal.search()
            life.observe(*executed(p))
            horizons.append(measured.horizon)
            prev = p
    finally:
        bal.close()
    assert min(horizons) < cost.horizon and bal.recorded == 10
