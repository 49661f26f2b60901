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
from collections.abc import Callable
from typing import Any

import pytest
import torch

from moonplan.comm.errors import ContractError
from moonplan.testing.dist import run_ranks
from tests.runtime.test_balancer_ahead import oracle_layer

pytestmark = pytest.mark.distributed

H = 8
SEARCH_US = 600.0  # against these tiny steps: lags above 1


def _x(rank: int, t: int) -> torch.Tensor:
    return torch.randn(24, H, generator=torch.Generator().manual_seed(100 * t + rank))


def _steps(rank: int, layer: Any, run: Callable, steps: int, before: Callable) -> dict:
    """Run ``steps`` forwards (``before(t)`` first); per step: how its candidate was
    chosen (``"failed"`` where it raised), its plan, its oracle error, the error text."""
    rt = layer.runtime
    hows, allocs, policies, errors, raised = [], [], [], [], []
    with torch.no_grad():
        for t in range(steps):
            before(t)
            try:
                _, err = run(_x(rank, t))
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
        lag = bal.ahead.last_lag  # set by launch() before the submit, read in the thread
        seen["lags"].append(lag)
        if rank == 1 and lag > 1 and seen["failed"] is None:
            seen["failed"] = lag
            raise RuntimeError("boom in a lagged search")
        return real(*args, **kw)

    balancer_module.choose_next = search  # this forked rank's module only
    started: dict[int, int] = {}

    def before(t: int) -> None:
        if not bal.ahead.searching and bal.ahead.policy() != "auto":
            started[t] = bal.ahead.lag()  # a search starts after step t, with this lag

    out = _steps(rank, layer, run, steps, before)
    layer.runtime.close()
    return {**out, "started": started, "failed_lag": seen["failed"], "lags": seen["lags"]}


def test_a_lagged_search_that_raises_on_one_rank_fails_every_rank_alike() -> None:
    """Rank 1's search with ``L > 1`` raises: at the step it names, every rank raises the
    same ContractError naming rank 1 (no hang, nobody waits past it); the next step
    chooses inline on every rank (the named candidate forgotten), then ahead again, with
    the same plans everywhere and outputs equal to the dense oracle."""
    steps = 16
    got = run_ranks(_failing_search, 3, steps, timeout=240)
    failed_lag = got[1]["failed_lag"]
    assert failed_lag is not None and failed_lag > 1
    for g in got:
        ((t, msg, ranks),) = g["raised"]
        assert (t, msg, ranks) == got[0]["raised"][0]
        assert ranks == (1,) and "choosing ahead failed: RuntimeError: boom in a lagged" in msg
    (t_fail, _, _) = got[0]["raised"][0]
    # it failed at the step its search named: started after step s with lag L, s + L
    (s,) = [s for s, lag in got[1]["started"].items() if s + lag == t_fail]
    assert got[1]["started"][s] == failed_lag
    hows = got[0]["hows"]
    assert hows[t_fail] == "failed" and hows[t_fail + 1] == "inline"
    assert set(hows[t_fail + 2 :]) == {"ahead"} and "inline" not in hows[1:t_fail]
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
