"""Failures around ``balance="auto"``'s choose-ahead search, on real process groups.

Legend: R ranks, E experts, K top-k, L the lag (steps ahead a search names).

With searches longer than a step (``L > 1``, forced by a large ``search_us`` against
tiny steps): a search that raises on one rank, a calibration while a search is in
flight, and a step that raises on every rank but at different places (some ranks
before their search starts, the others after). Every rank must fail alike at the same
step and plan alike afterwards, with outputs equal to the dense oracle
(``moonplan.runtime.balancer``, "Failures").
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from moonplan.comm.errors import ContractError
from moonplan.runtime.balancer import WARMUP_STEPS
from moonplan.testing.dist import run_ranks
from tests.runtime.test_balancer_ahead import oracle_layer

pytestmark = pytest.mark.distributed

H = 8
SEARCH_US = 10.0  # against these tiny steps: lags above 1


def _x(rank: int) -> torch.Tensor:
    """The rank's tokens (the same each step: the router drifts with the step)."""
    return torch.randn(24, H, generator=torch.Generator().manual_seed(rank))


def _steps(rank: int, layer: Any, run: Callable, steps: int, before: Callable) -> dict:
    """Run ``steps`` forwards (``before(t)`` first); per step: how its candidate was
    chosen (``"failed"`` where it raised), its plan, its oracle error, the error text."""
    rt = layer.runtime
    hows, allocs, policies, errors, raised = [], [], [], [], []
    with torch.no_grad():
        for t in range(steps):
            before(t)
            try:
                _, err = run(_x(rank))
            except ContractError as exc:
                hows.append("failed")
                raised.append((t, str(exc), exc.ranks))
                allocs.append(None)
                policies.append(None)
                continue
            hows.append(layer.last_stats.choice)
            allocs.append(rt.last_plan.alloc)
            policies.append(rt.last_plan.policy)
            errors.append(err)
    return {"hows": hows, "alloc": allocs, "policies": policies, "errors": errors,
            "raised": raised}  # fmt: skip


def _same_plans(got: list[dict]) -> None:
    first = got[0]
    for g in got:
        assert g["hows"] == first["hows"] and g["policies"] == first["policies"]
        for a, b in zip(g["alloc"], first["alloc"], strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
        assert max(g["errors"]) < 1e-4


# ---- a search that raises on one rank while a search with L > 1 is in flight -------------
def _failing_search(rank: int, world: int, steps: int) -> dict:
    import moonplan.runtime.balancer as balancer_module

    layer, run = oracle_layer(rank, SEARCH_US)
    bal = layer.runtime.balancer
    real = balancer_module.choose_next
    seen: dict[str, Any] = {"failed": None, "lags": []}

    def search(*args: Any, **kw: Any) -> Any:
        # set by launch() before the submit and kept until taken: read in the thread
        lag, named = bal.ahead.last_lag, bal.ahead._due
        seen["lags"].append(lag)
        if rank == 1 and lag > 1 and seen["failed"] is None:
            seen["failed"] = (lag, named)
            raise RuntimeError("boom in a lagged search")
        return real(*args, **kw)

    balancer_module.choose_next = search  # this forked rank's module only
    out = _steps(rank, layer, run, steps, lambda t: None)
    layer.runtime.close()
    return {**out, "failed": seen["failed"], "lags": seen["lags"]}


def test_a_lagged_search_that_raises_on_one_rank_fails_every_rank_alike() -> None:
    """Rank 1's search with ``L > 1`` raises: at the step it names, every rank raises the
    same ContractError naming rank 1 (no hang, nobody waits past it); the next step
    chooses inline on every rank (the named candidate forgotten), then ahead again, with
    the same plans everywhere and outputs equal to the dense oracle."""
    steps = 16
    got = run_ranks(_failing_search, 3, steps, timeout=240)
    assert got[1]["failed"] is not None
    lag, named = got[1]["failed"]
    assert lag > 1
    for g in got:
        ((t, msg, ranks),) = g["raised"]
        assert (t, msg, ranks) == got[0]["raised"][0]
        assert ranks == (1,) and "choosing ahead failed: RuntimeError: boom in a lagged" in msg
    (t_fail, _, _) = got[0]["raised"][0]
    assert t_fail == named  # at the step the failed search named
    hows = got[0]["hows"]
    assert hows[t_fail] == "failed" and hows[t_fail + 1] == "inline"
    assert set(hows[t_fail + 2 :]) == {"ahead"} and "inline" not in hows[1:t_fail]
    assert len(set(got[0]["policies"])) >= 2  # the choice really moves
    _same_plans(got)


# ---- calibration while a search with L > 1 is in flight ------------------------------------
def _calibrate_in_flight(rank: int, world: int, steps: int) -> dict:
    import moonplan.runtime.balancer as balancer_module

    layer, run = oracle_layer(rank, SEARCH_US)
    bal = layer.runtime.balancer
    real = balancer_module.choose_next
    running: dict[str, Any] = {"n": 0, "results": []}

    def slow(*args: Any, **kw: Any) -> Any:
        running["n"] += 1
        time.sleep(0.3)  # still running when the step calibrates
        found = real(*args, **kw)
        running["results"].append(found)
        return found

    balancer_module.choose_next = slow
    seen: dict[str, Any] = {}

    def before(t: int) -> None:
        if "at" in seen or not (bal.ahead.searching and bal.ahead.last_lag > 1):
            return
        pending = bal._search
        assert pending is not None and not pending.done  # in flight, not finished
        seen["at"], seen["lag"], seen["named"] = t, bal.ahead.last_lag, bal.ahead.policy()
        layer.calibrate()  # collective, every rank at this same step
        seen["finished"] = pending.done  # drained: the search ran to its end...
        seen["after"] = (bal.ahead.searching, bal.ahead.policy(), bal._search is None, bal._made)

    out = _steps(rank, layer, run, steps, before)
    layer.runtime.close()
    return {**out, **seen, "cost": bal.cost.as_tensor()}


def test_calibration_while_a_lagged_search_is_in_flight_forgets_it_everywhere() -> None:
    """``layer.calibrate()`` with a search of ``L > 1`` still running: every rank waits for
    it and forgets it (nothing in flight, no candidate in force), the next step searches
    inline with the agreed model on every rank, the later ones ahead, with the same plans
    everywhere and outputs equal to the dense oracle."""
    steps = 12
    got = run_ranks(_calibrate_in_flight, 2, steps, timeout=240)
    first = got[0]
    at = first["at"]
    assert first["lag"] > 1 and 0 < at < steps - 3
    for g in got:
        assert (g["at"], g["lag"], g["named"]) == (at, first["lag"], first["named"])
        assert g["finished"] and g["after"] == (False, "auto", True, None)
        assert torch.equal(g["cost"], first["cost"])  # the agreed model
        assert g["raised"] == []
    hows = first["hows"]
    assert hows[at] == "inline" and set(hows[at + 1 :]) == {"ahead"}
    assert "inline" not in hows[1:at]
    _same_plans(got)


# ---- a step that raises after planning on some ranks -------------------------------------
class Injected(RuntimeError):
    """The fault this test injects."""


def _split_failure(rank: int, world: int, steps: int, faults: tuple[str | None, ...]) -> dict:
    """At the first step after which a search starts (the same step on every rank), this
    rank raises in ``faults[rank]`` of ``moonplan.runtime.layer_runtime`` (``None``: it
    does not): ``route_tokens`` is before its search starts, ``MoEStep`` after it, before
    the step's first collective, ``StepStats`` after the step's last collective."""
    import moonplan.runtime.layer_runtime as layer_module

    layer, run = oracle_layer(rank, SEARCH_US)
    bal = layer.runtime.balancer
    armed = {"on": False}
    name = faults[rank]
    if name is not None:
        real = getattr(layer_module, name)

        def fault(*args: Any, **kw: Any) -> Any:
            if armed["on"]:
                armed["on"] = False
                raise Injected(f"injected into {name} on rank {rank}")
            return real(*args, **kw)

        setattr(layer_module, name, fault)
    seen: dict[str, Any] = {"at": None}

    def before(t: int) -> None:
        if seen["at"] is None and t >= 2 and bal.ahead.due():  # a search starts after t
            seen["at"], armed["on"] = t, True

    def step(x: torch.Tensor) -> tuple[torch.Tensor, float]:
        try:
            return run(x)
        except Injected as exc:  # recorded as a failed step
            raise ContractError(str(exc), (rank,)) from exc

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        out = _steps(rank, layer, step, steps, before)
    layer.runtime.close()
    return {**out, **seen, "warned": [str(w.message) for w in warned]}


@pytest.mark.parametrize(
    "faults",
    [
        ("MoEStep", "route_tokens", "MoEStep"),  # rank 1 one step behind the others
        ("route_tokens", "MoEStep", "route_tokens"),  # rank 1 one step ahead
        (None, "StepStats", None),  # rank 1 alone, after the step's collectives
    ],
)
def test_a_step_that_raises_after_planning_on_some_ranks_resynchronises_every_rank(
    faults: tuple[str | None, ...],
) -> None:
    """A step raises after its plan was made on some ranks, some before their search
    started and some after (their choose-ahead schedules now differ; without the check
    the ranks then build different candidates and the outputs are wrong), or on one
    rank after the step's collectives: the next counts exchange carries each rank's
    schedule, and every rank resynchronises alike (one warning, the search and named
    candidate forgotten, residents dropped, the step chooses inline), so every step
    after plans alike on every rank, with outputs equal to the dense oracle."""
    steps = 12
    got = run_ranks(_split_failure, 3, steps, faults, timeout=240)
    at = got[0]["at"]
    assert at is not None and at < steps - 3
    for rank, g in enumerate(got):
        assert g["at"] == at
        assert [r[0] for r in g["raised"]] == ([] if faults[rank] is None else [at])
        assert len(g["warned"]) == 1 and "every rank resynchronises" in g["warned"][0]
        assert g["warned"] == got[0]["warned"]
        assert g["hows"][at + 1] == "inline" and "ahead" in g["hows"][at + 2 :]
        assert g["hows"][at + 1 :] == got[0]["hows"][at + 1 :]
        assert g["policies"][at + 1 :] == got[0]["policies"][at + 1 :]
        for a, b in zip(g["alloc"][at + 1 :], got[0]["alloc"][at + 1 :], strict=True):
            assert torch.equal(a, b)
        assert max(g["errors"]) < 1e-4


def _warmup_failure(rank: int, world: int, fail_at: int) -> dict:
    """No cost model: the layer calibrates after its measured warm-up steps. Rank 1 raises
    after the collectives of step ``fail_at`` (its measurement of that step is lost)."""
    import moonplan.runtime.layer_runtime as layer_module
    from moonplan import MoonMoE

    real = layer_module.StepStats
    state = {"t": 0}

    def stats(*args: Any, **kw: Any) -> Any:
        if rank == 1 and state["t"] == fail_at:
            raise Injected("injected into StepStats")
        return real(*args, **kw)

    layer_module.StepStats = stats
    layer = MoonMoE(H, 8, 6, 2, choose="ahead")
    hows = []
    with warnings.catch_warnings(record=True), torch.no_grad():
        warnings.simplefilter("always")
        for t in range(WARMUP_STEPS + 6):
            state["t"] = t
            try:
                layer(_x(rank))
                hows.append(layer.last_stats.choice)
            except Injected:
                hows.append("failed")
    layer.runtime.close()
    return {"hows": hows}


def test_a_lost_warm_up_measurement_on_one_rank_restarts_the_warm_up_everywhere() -> None:
    """Rank 1 loses one warm-up step's measurement (it raised after the step's
    collectives): every rank starts the warm-up over at the next step and calibrates at
    the same later step (a calibration on some ranks only would be a collective the
    others never enter)."""
    fail_at = 2
    got = run_ranks(_warmup_failure, 2, fail_at, timeout=60)
    want = ["none"] * (fail_at + 1 + WARMUP_STEPS + 1) + ["inline", "ahead"]
    want[fail_at] = "failed"  # rank 1 only
    assert got[1]["hows"] == want[: len(got[1]["hows"])]
    assert got[0]["hows"][fail_at] == "none"
    assert got[0]["hows"][fail_at + 1 :] == got[1]["hows"][fail_at + 1 :]


def test_resync_compares_the_schedules_and_forgets_alike() -> None:
    """``Balancer.resync``: equal schedules change nothing; different ones warn, forget the
    search in flight, the named candidate, the counters and the measured steps."""
    from moonplan.runtime.balancer import Balancer
    from tests.runtime.test_balancer_ahead import _cost, _trace

    bal = Balancer("auto", slots=2, align=1, cost=_cost(), search_s=6e-4)
    prev = None
    try:
        for t, counts in enumerate(_trace(4, 4, 16, 5)):
            assert bal.collect() == ""
            prev = bal.plan(counts, prev)
            bal.search()
            bal.record(prev, 0, 10, {"counts": 1e-4})
            assert bal.schedule() == (t + 1, t + 1)
        assert bal.ahead.searching and bal.ahead.policy() != "auto" and len(bal.samples) == 3
        assert not bal.resync(torch.tensor([[4, 4], [4, 4]]))
        assert bal.ahead.searching and bal.schedule() == (4, 4)
        with pytest.warns(RuntimeWarning, match=r"\[\(4, 4\), \(4, 3\)\]"):
            assert bal.resync(torch.tensor([[4, 4], [4, 3]]))
        assert not bal.ahead.searching and bal.ahead.policy() == "auto"
        assert bal._search is None and bal.schedule() == (0, 0) and len(bal.samples) == 0
    finally:
        bal.close()
