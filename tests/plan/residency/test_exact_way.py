"""The exact way: the chain of exact plans over the window, its charge, and when it is chosen."""

from __future__ import annotations

import torch

import moonplan
from moonplan.plan.plan_time import plan_time
from moonplan.plan.residency.exact_way import EXACT, exact_charge_s, exact_steps_s
from moonplan.plan.residency.serving import serving_plan
from moonplan.plan.residency.target import target_of, window_rows
from moonplan.plan.residency.work import Builds
from tests.plan.choice.costs import rows_only
from tests.plan.draw import hot_steps


def _window(steps: int = 6) -> torch.Tensor:
    """int64 ``[S, 4, 16]``: a window of steps with a persistent hot set, each spread over
    the sources as the decision spreads them."""
    loads_SE = torch.stack(
        [c.sum(0) for c in hot_steps(steps, 4, 16, (0, 5), low=5, high=15, extra=300)]
    )
    return window_rows(loads_SE.sum(0), steps, 4, loads_SE)


def test_the_charge_is_the_exact_call_or_else_a_full_auto_call() -> None:
    assert exact_charge_s(rows_only(plan_s=3e-4, exact_s=2e-5)) == 2e-5
    assert exact_charge_s(rows_only(plan_s=3e-4)) == 3e-4  # not measured: the dearer call


def test_the_chain_is_the_exact_plans_from_the_serving_slots_newest_first() -> None:
    """Each step's plan is ``policy="exact"`` with ``previous=`` the one before, the first
    from the serving slots at the newest step; each is charged its own predicted time (its
    copies included) and one exact call; every plan counts as a build."""
    cost = rows_only(copy_s_intra=1e-5, copy_s_inter=1e-5, exact_s=7e-6)
    rows_SRE = _window()
    slot_RB = torch.tensor([[5, -1], [0, -1], [-1, -1], [-1, -1]])
    builds = Builds()
    got = exact_steps_s(cost, rows_SRE, slot_RB, builds)
    previous, want = serving_plan(rows_SRE[-1], slot_RB), []
    for c_RE in reversed(list(rows_SRE)):
        previous = moonplan.plan(c_RE, slots=2, previous=previous, policy="exact")
        want.append(plan_time(cost, previous, planned=0).total_s + 7e-6)
    assert got == want and builds.made == len(rows_SRE)


def test_exact_balance_is_chosen_where_calls_are_dear_and_the_exact_kernel_is_not() -> None:
    """With ``auto``'s call dear and copies dear (no refill pays), but the exact kernel
    cheap, the window prefers exact balance every step over every table: the target is the
    serving table, served the exact way; with the exact kernel as dear as the call, a lookup
    or a table served by calls wins instead."""
    rows_SRE = _window()
    loads_SE = rows_SRE.sum(1)
    empty = torch.full((4, 2), -1, dtype=torch.int64)
    cheap = rows_only(exit_s=1e-3, plan_s=1e-3, exact_s=1e-7)
    got = target_of(loads_SE.sum(0), len(loads_SE), empty, cheap, loads_SE)
    assert got.serve == got.kept == EXACT and torch.equal(got.slot_RB, empty)
    dear = cheap.scaled(exact_s=1e-3)
    got = target_of(loads_SE.sum(0), len(loads_SE), empty, dear, loads_SE)
    assert got.serve != EXACT and got.kept != EXACT


def test_without_a_chain_every_step_plans_from_empty_slots() -> None:
    """Where no slot stays (training), each step's exact plan starts from empty slots."""
    cost = rows_only(copy_s_intra=1e-5, copy_s_inter=1e-5, exact_s=7e-6)
    rows_SRE = _window(3)
    got = exact_steps_s(cost, rows_SRE, torch.full((4, 2), -1), chain=False)
    want = [plan_time(cost, moonplan.plan(c, slots=2, policy="exact"), planned=0).total_s
            + 7e-6 for c in reversed(list(rows_SRE))]  # fmt: skip
    assert got == want


def test_where_slots_go_stale_the_way_is_a_lookup_a_call_or_the_exact_kernel() -> None:
    """Steps whose slots go stale: the exact kernel where it is cheap and balance pays;
    static EP's lookup (no call) where every call is dear."""
    from moonplan.plan.residency.serving import LOOKUPS
    from moonplan.plan.residency.stale_steps import stale_steps

    rows_SRE = _window()
    cheap = rows_only(copy_s_intra=1e-9, copy_s_inter=1e-9, exit_s=1e-3, plan_s=1e-3,
                      exact_s=1e-9)  # fmt: skip
    assert stale_steps(cheap, rows_SRE, 2).best()[1] == EXACT
    assert stale_steps(cheap.scaled(exact_s=1.0), rows_SRE, 2).best()[1] in LOOKUPS
