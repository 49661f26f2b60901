"""The exact way: ``policy="exact"`` with ``previous=`` every step, scored over the window.

Legend:
    S steps    R ranks    E experts    B slots per rank
    rows_SRE   int64 ``[S, R, E]`` the window's steps, each spread over the sources
    slot_RB    int64 ``[R, B]`` the serving slots (``-1``: empty)

A lookup or a planner call serves a slot table that stays until a refill changes it. The
exact way keeps no table: each step's exact plan gives every rank the same records,
reuses the slots of the plan before it (``previous=``) and copies what else it needs on
the critical path. That is ``moonplan-resident``; it wins where the window's steps are
large enough for exact balance to pay its copies, and its kernel is 10-19x cheaper than
``auto``'s call (its early exit or a full one) on an H200
(``moonplan.baselines.planner_time``).

Its predicted time over the window is the chain of its plans from the serving slots, each
step its own plan's time (``plan_time``: the copies it makes included) and one exact call
(:func:`exact_charge_s`). The chain starts where the next steps will, from the serving
slots at the newest step, and runs back through the window: a chain keeps the slots its
first plan chose (``previous=``), and its first plan decides much of its time. (Across
hosts, DeepSeek-V3 at EP 16 and sigma 2, one exact plan costs 80 or 95 ms by which hot
expert it splits across hosts; a chain from the window's oldest step predicted 77 ms where
the steps that followed ran 95.) The same cost model scores the tables' other ways
(``target.table_ways``), so the decision compares like with like.
"""

from __future__ import annotations

import torch

from moonplan.plan import api as planner
from moonplan.plan.plan_time import plan_time
from moonplan.plan.residency.serving import serving_plan
from moonplan.plan.residency.work import Builds
from moonplan.stepcost import StepCost
from moonplan.stepcost.training import training_time

EXACT = "exact"
"""The name of the exact way (``Target.serve``, ``Decisions.serve``)."""


def exact_charge_s(cost: StepCost) -> float:
    """Seconds charged for one exact call: ``cost.exact_s``, or where it is not set
    (not measured), ``cost.plan_s``, the full ``auto`` call that builds the exact plan
    among its candidates."""
    return cost.exact_s if cost.exact_s > 0 else cost.plan_s


def exact_steps_s(
    cost: StepCost,
    rows_SRE: torch.Tensor,
    slot_RB: torch.Tensor,
    builds: Builds | None = None,
    chain: bool = True,
    training: bool = False,
) -> list[float]:
    """Predicted seconds of each step of ``rows_SRE`` (the oldest first) served the exact
    way from the slots ``slot_RB`` (module docstring), its call included, newest first.
    ``chain=False``: no slot stays from one step to the next: each plan from empty slots,
    every replica copied. ``training``: each step is charged its backward too
    (``moonplan.stepcost.training``). ``builds`` counts each plan as one build
    (``work.Builds.made``)."""
    B = slot_RB.shape[1]
    previous = serving_plan(rows_SRE[-1], slot_RB.to(rows_SRE.device)) if chain else None
    charge, out = exact_charge_s(cost), []
    for counts_RE in rows_SRE.flip(0):
        p = planner.plan(counts_RE, slots=B, previous=previous, policy=EXACT)
        t = plan_time(cost, p, planned=0)
        out.append((training_time(t).total_s if training else t.total_s) + charge)
        previous = p if chain else None
    if builds is not None:
        builds.made += len(rows_SRE)
    return out
