"""Host reads (synchronisations on a GPU) of one layer step: planning and routing make none.

Legend: R ranks, E experts, H hidden, F ffn, K top-k, S tokens.

On the CPU nothing waits, but the host-work counter (``tests/plan/host_work.py``) sees the
ops a GPU step makes: a read where a value comes back to the host. The planner's CPU
shortcuts (host scans, which read freely there) are swapped for the forms a GPU runs
(``moonplan.plan.choice.tensor``, ``plan_torch(scan="tensor")``, ``route``'s tensor form),
so the count is what one step on the heap transport costs on a device.
``docs/runtime.md`` ("Host reads per step") lists the reads that remain and why.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest
import torch

from moonplan.stepcost import StepCost
from moonplan.testing.dist import run_ranks

pytestmark = pytest.mark.distributed

H, F, E, K = 8, 12, 8, 2


def _device_forms(monkeypatch: Any) -> None:
    """The planner's and the router's GPU forms on CPU tensors."""
    import importlib

    from moonplan.plan import api

    monkeypatch.setattr(api, "_path", lambda backend, device: "tensor")
    monkeypatch.setattr(api, "plan_torch", functools.partial(api.plan_torch, scan="tensor"))
    monkeypatch.setattr(importlib.import_module("moonplan.plan.route"), "HOST_FORM", False)


def _step_reads(rank: int, world: int, balance: str) -> dict[str, Any]:
    import moonplan.runtime.balancer as balancer_mod
    import moonplan.runtime.layer_runtime as lr
    from moonplan import MoonMoE
    from tests.plan.host_work import host_work

    with pytest.MonkeyPatch.context() as mp:
        _device_forms(mp)
        cost = StepCost.from_hardware("h200-node", "deepseek-v3", plan_us=20.0, exit_us=1.0)
        cost = cost.scaled(copy_s_intra=1e-7, copy_s_inter=1e-7)  # auto builds replicas
        layer = MoonMoE(H, F, E, K, balance=balance, transport="heap", slots=2,
                        cost=cost if balance == "auto" else None)  # fmt: skip
        parts: dict[str, int] = {"plan": 0, "route": 0}
        step_thread = threading.get_ident()

        def counted(name: str, fn: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if threading.get_ident() != step_thread:  # the placer's decision thread
                    return fn(*args, **kwargs)  # (its exact way plans a chain beside)
                out = []
                parts[name] += host_work(lambda: out.append(fn(*args, **kwargs))).host_reads
                return out[0]

            return wrapper

        mp.setattr(balancer_mod.planner, "plan", counted("plan", balancer_mod.planner.plan))
        mp.setattr(lr, "route_tokens", counted("route", lr.route_tokens))
        gen = torch.Generator().manual_seed(rank)
        total = []
        for _ in range(3):
            x = torch.randn(6 + 3 * rank, H, generator=gen)
            with torch.no_grad():
                w = host_work(lambda x=x: layer(x))
            total.append(w.host_reads)
        layer.runtime.close()
        return {**parts, "total": total, "policy": layer.last_stats.policy}


@pytest.mark.parametrize("balance", ["off", "exact", "auto"])
def test_planning_and_routing_read_nothing_on_the_host(balance: str) -> None:
    got = run_ranks(_step_reads, 2, balance, timeout=120)
    for g in got:
        assert g["plan"] == 0 and g["route"] == 0, g
        allowed = READS_PER_STEP + (CHOICE_READS + DECISION_READS if balance == "auto" else 0)
        assert max(g["total"]) <= allowed, g  # what remains (docs/runtime.md)


READS_PER_STEP = 22
"""The step's other host reads, the most measured (``balance="off"`` and ``"exact"``): see
docs/runtime.md, "Host reads per step". The expert sections read none of their own (their
row offsets come with the plan's one read); were they back, a step would read 6 more."""

CHOICE_READS = 5
"""``balance="auto"`` on a step whose plan scored candidates: its choice (predictions, early
exit), read for the step's figures."""

DECISION_READS = 2
"""A refill's request (``balance="auto"``: the target checked and agreed). The decision
itself reads on the placer's worker thread, beside the steps."""


@pytest.mark.parametrize("how", ["placed", "split", "weighted"])
def test_a_lookup_step_reads_nothing_on_the_host(how: str) -> None:
    """A step ``auto`` serves by a lookup of the slots (``Balancer.serve``; the weighted one
    with its shares, which the placer copies to the device once a verdict) reads nothing
    on the host: no call, no check."""
    from moonplan.plan.residency.serving import serving_plan
    from moonplan.plan.residency.shares import Shares
    from moonplan.runtime.balancer import Balancer
    from tests.plan.host_work import host_work

    g = torch.Generator().manual_seed(1)
    counts_RE = torch.randint(0, 40, (4, 8), generator=g)
    previous = serving_plan(counts_RE, torch.tensor([[-1, -1], [0, -1], [0, 7], [1, -1]]))
    w_ER = torch.randint(1, 9, (8, 4), generator=g)
    shares = Shares(w_ER) if how == "weighted" else None
    bal = Balancer("auto", slots=2, align=1)
    out: list[Any] = []
    work = host_work(lambda: out.append(bal.serve(counts_RE, previous, how, shares)))
    assert work.host_reads == 0 and out[0].requested == how
