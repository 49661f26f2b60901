"""Whether ``policy="auto"`` keeps its previous choice instead of choosing again.

Legend:
    R ranks, E experts
    load       static loads (records of each rank's home experts), int list [R]
    gap_s      the runner-up's score (or screen bound) minus the winner's, seconds
    record_s   the most one record adds to a step by the cost model's rates, seconds

A full choice (``moonplan.plan.choose``) records a ``Basis`` on its plan; the next
steps keep its candidate while :func:`keeps` says the order of the candidates cannot
have turned (``docs/planner-policy.md``, "Keeping the previous choice").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moonplan.plan.choose import CostModel, Inputs

KEEP_FIELDS = ("row_flop_s", "row_mem_s", *(f"{p}_row_s_{c}" for p in ("dispatch", "combine")
                                            for c in ("intra", "inter")))  # fmt: skip


def record_s(cost: CostModel, num_ranks: int) -> float | None:
    """Seconds one more record can add to a candidate's step on ``num_ranks`` ranks, by
    ``cost``'s rates: its row's compute (flop and memory, tile padding aside) plus its
    dispatch and combine over the slower link class the ranks use (intra only when one
    fast-link domain holds them all). ``None`` for a cost model without those fields
    (it never keeps)."""
    if not all(hasattr(cost, n) for n in (*KEEP_FIELDS, "domain_size")):
        return None
    r = {n: float(getattr(cost, n)) for n in KEEP_FIELDS}
    one_domain = int(getattr(cost, "domain_size")(num_ranks)) >= num_ranks  # noqa: B009
    classes = ("intra",) if one_domain else ("intra", "inter")
    link = sum(max(r[f"{p}_row_s_{c}"] for c in classes) for p in ("dispatch", "combine"))
    return r["row_flop_s"] + r["row_mem_s"] + link


def keeps(inp: Inputs, load: list[int], cost: CostModel) -> bool:
    """Whether ``auto`` keeps the previous plan's candidate without choosing again.

    Only after a full choice (``prev_basis``) fewer than ``basis.every`` steps ago, and
    only while no rank's static load has moved from the one that choice saw by more than
    ``gap_s / (2 * record_s)`` records (``gap_s``: how far the runner-up's score, or the
    lower bound of a screened-out one's, was above the best's; :func:`record_s`: the
    most one record adds to a step). A rank's target under any candidate (its static
    load, the mean, a capped or filled level) moves by at most the largest static-load
    move, so each score moves by at most that times ``record_s`` in the model's linear
    terms, and the two together cannot close the gap. Not covered: tile padding and
    first-record weight reads, which the full choice every ``basis.every`` steps
    (:func:`refresh_every`) catches. ``O(E*R)`` for the static loads, then ``O(R)``: a
    pure function of the counts, the previous plan and the cost model.
    """
    b, per = inp.prev_basis, record_s(cost, len(load))
    if b is None or inp.prev_policy is None or per is None or len(b.load) != len(load):
        return False
    if b.kept + 1 >= b.every or b.gap_s <= 0:
        return False
    moved = max(abs(x - x0) for x, x0 in zip(load, b.load, strict=True))
    return moved * per * 2 <= b.gap_s


REFRESH_SHARE = 0.01
"""The full choices' share of the step time, at most, on average over kept steps."""


def refresh_every(full_s: float, best_s: float) -> int:
    """Steps between full choices (:func:`keeps`): the fewest that bring a full choice's
    charge ``full_s`` (its runs and its own work) down to :data:`REFRESH_SHARE` of the best
    score ``best_s`` per step; 1 (choose every step) when the choice costs nothing."""
    if full_s <= 0 or best_s <= 0:
        return 1
    return max(1, math.ceil(full_s / (REFRESH_SHARE * best_s)))


def gap(best_s: float, times: dict[str, float]) -> float:
    """The least of ``times`` (scores, or lower bounds of the screened-out candidates' scores
    with their planner runs) above the best score ``best_s``, minus it (0 with no other):
    the runner-up's lead, at least."""
    s = sorted(times.values())
    return s[1] - best_s if len(s) > 1 else 0.0
