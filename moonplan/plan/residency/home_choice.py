"""Whether a home order from the window's loads is predicted to serve it faster.

Legend:
    R ranks    E experts    B slots per rank    S the window's steps
    loads_SE   int64 ``[S, E]`` records per step and expert label (the window's)
    slot_RB    int64 ``[R, B]`` the slot table serving now (``-1``: empty)
    perm_E     a permutation of the labels: new label ``j`` is old label ``perm_E[j]``

:func:`~moonplan.plan.home_order.popular_order` spreads the window's heavy experts over
the ranks, which lowers static EP's busiest rank. Two orders are offered
(:func:`candidate_orders`): that popular order of whole loads (:func:`window_order`), and
:func:`shared_order`, the popular order of each expert's load per holder once the slot
budget's replicas are given out, as EPLB packs replicas, not experts. The first spreads
loads that the replicas will split: the hot expert's rank gets the lightest companions
and idles once its replicas take most of its records. Whether the steps get faster
depends on how they are served, so an order is taken only where the cost model predicts
the window's steps faster under it (:func:`judged_order`), each map judged by what it
would serve next:

* **A running layer** (``serving_RB`` given) keeps its map and its slot table, served the
  table's best way (:func:`serving_s`). A re-home empties the slots, and under the order a
  table arrives only through decisions and refills, which lag (on decode-sized steps one
  decision counts more steps of work than a recorded trace's warm-up). So an order is
  judged with no slot kept (:func:`map_way`: static EP, a planner call or the exact kernel
  from empty slots), and must beat the running layer at once. Where both orders do, the
  one whose best table from empty slots is faster (:func:`table_way`) is taken: it serves
  the layer once its decisions have placed that table, for as long as the layer runs.
* **Before a trace** (``serving_RB`` ``None``), where every policy's placement is made
  from the window at no charge (EPLB's as well as the slots'), each map is judged by its
  best table from empty slots (:func:`table_way`).

Judged by best tables alone at a running layer, the popular order was refused at two
recorded points where it then ran 12% and 4% faster; judged with no slot kept before a
trace, it was taken at a generated point where it then ran 1.061x EPLB, the linear map at
most 1.0x (docs/benchmarks.md, "Auto re-homes while serving"). No threshold enters. What
a re-home costs once (its rows' moves) is for its caller, who makes it once, to weigh.

**In training** no slot outlives a step, so both maps are judged with no slot kept
(``judged_order(stale=True)``), each step with its backward (which replays the plan, so
an order's saving counts about three times its forward's), and ``auto`` re-homes as often
as rent or buy says: a
decision's :func:`stale_offer` (the seconds a step saves under the window's order)
accrues against ``refill.rehome_link_s`` (the moved rows' link time, with their
gradients and optimizer state) in ``refill.Residency``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moonplan.plan.home_order import popular_order
from moonplan.plan.residency.exact_way import exact_steps_s
from moonplan.plan.residency.serving import empty_slots
from moonplan.plan.residency.stale_steps import StaleSteps, stale_steps
from moonplan.plan.residency.target import replica_counts, table_ways, target_of, window_rows
from moonplan.plan.residency.work import Builds
from moonplan.stepcost import StepCost


@dataclass(frozen=True)
class HomeOffer:
    """A home order judged faster for a window's steps (:func:`judged_order`,
    :func:`stale_offer`).

    Attributes:
        perm_E: the order, in labels (new label ``j`` is old label ``perm_E[j]``).
        saving_s: seconds a step saves under it, as predicted (:func:`stale_offer`: held
            out, on steps it was not fit to).
        serve: how the steps are served once it is taken, until a decision judges them
            again: the way of least predicted time under it with no slot kept
            (``stale_steps.StaleSteps.best``; before a trace, its best table's way).
        stale: judged for steps whose slots go stale (training).
    """

    perm_E: tuple[int, ...]
    saving_s: float
    serve: str
    stale: bool = False


def _rows(loads_SE: torch.Tensor, num_ranks: int) -> torch.Tensor:
    return window_rows(loads_SE.sum(0).cpu(), loads_SE.shape[0], num_ranks, loads_SE)


def map_way(
    cost: StepCost,
    loads_SE: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    builds: Builds | None = None,
    training: bool = False,
) -> tuple[float, str]:
    """Least predicted seconds of the window's steps under the labels' linear home map
    with no slot kept between steps, and the way that gives it (``StaleSteps.best``;
    ``training``: each step with its backward)."""
    rows_SRE = _rows(loads_SE, num_ranks)
    return stale_steps(cost, rows_SRE, num_slots, loads_SE, builds, training).best()


def table_way(
    cost: StepCost,
    loads_SE: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    builds: Builds | None = None,
) -> tuple[float, str]:
    """Least predicted seconds of the window's steps under the labels' linear home map,
    served by the best table from empty slots, and its way (``target.target_of``)."""
    if num_slots == 0:
        return map_way(cost, loads_SE, num_ranks, 0, builds)
    totals_E, S = loads_SE.sum(0).cpu(), loads_SE.shape[0]
    empty_RB = empty_slots(num_ranks, num_slots)
    got = target_of(totals_E, S, empty_RB, cost, loads_SE, builds)
    return got.seconds, got.serve


def serving_s(
    cost: StepCost, loads_SE: torch.Tensor, slot_RB: torch.Tensor, builds: Builds | None = None
) -> float:
    """Least predicted seconds of the window's steps served by ``slot_RB`` (kept), its
    best way: a lookup, planner calls, or the exact kernel from it."""
    rows_SRE = _rows(loads_SE, slot_RB.shape[0])
    slot_RB = slot_RB.cpu()
    best = table_ways(cost, rows_SRE, slot_RB[None], loads_SE, builds)[0][0]
    return min(best, sum(exact_steps_s(cost, rows_SRE, slot_RB, builds)))


def judged_order(
    cost: StepCost,
    loads_SE: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    serving_RB: torch.Tensor | None = None,
    builds: Builds | None = None,
    *,
    stale: bool = False,
) -> HomeOffer | None:
    """The order of :func:`candidate_orders` (module docstring) predicted fastest for the
    window's steps, and the way its steps are then served (:class:`HomeOffer`), where it
    beats the labels as they are; else ``None`` (also for an empty window and where every
    order is the identity). Judged against ``serving_RB``, the running layer's table,
    with no slot kept (:func:`_running`); ``None``: before a trace, best tables both
    (:func:`_before_trace`); ``stale``, training, where no slot outlives a step: the
    popular order alone, both maps with no slot kept (no table to anticipate)."""
    if stale:
        return _stale_judged(cost, loads_SE, loads_SE, num_ranks, num_slots, builds)
    orders = candidate_orders(loads_SE, num_ranks, num_slots)
    if serving_RB is None:
        return _before_trace(cost, loads_SE, num_ranks, num_slots, orders, builds)
    return _running(cost, loads_SE, serving_RB, orders, builds)


def candidate_orders(loads_SE: torch.Tensor, num_ranks: int, num_slots: int) -> list[list[int]]:
    """The orders a serving layer's judgement weighs (module docstring): :func:`window_order`
    and :func:`shared_order`, each once, without the identity; empty for an empty window."""
    found = (window_order(loads_SE, num_ranks), shared_order(loads_SE, num_ranks, num_slots))
    return [p for i, p in enumerate(found) if p is not None and p not in found[:i]]


def _running(
    cost: StepCost,
    loads_SE: torch.Tensor,
    serving_RB: torch.Tensor,
    orders: list[list[int]],
    builds: Builds | None = None,
) -> HomeOffer | None:
    """:func:`judged_order` at a running layer: of ``orders``, those whose steps with no
    slot kept beat ``serving_RB`` served its best way; of two, the one whose best table is
    faster (the first where they tie)."""
    R, B = serving_RB.shape
    now = serving_s(cost, loads_SE, serving_RB, builds)
    faster = []
    for perm_E in orders:
        after, way = map_way(cost, relabelled(loads_SE, perm_E), R, B, builds)
        if after < now:
            faster.append((perm_E, after, way))
    if not faster:
        return None
    if len(faster) > 1:
        steady = [table_way(cost, relabelled(loads_SE, p), R, B, builds)[0] for p, _, _ in faster]
        faster = [faster[min(range(len(faster)), key=steady.__getitem__)]]
    perm_E, after, way = faster[0]
    return HomeOffer(tuple(perm_E), (now - after) / loads_SE.shape[0], way)


def _before_trace(
    cost: StepCost,
    loads_SE: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    orders: list[list[int]],
    builds: Builds | None = None,
) -> HomeOffer | None:
    """:func:`judged_order` before a trace: of ``orders``, the one whose best table from
    empty slots is predicted fastest (the first where they tie), where it beats the
    labels' own best table."""
    if not orders:
        return None
    now = best_s = table_way(cost, loads_SE, num_ranks, num_slots, builds)[0]
    best = None
    for perm_E in orders:
        after, way = table_way(cost, relabelled(loads_SE, perm_E), num_ranks, num_slots, builds)
        if after < best_s:
            best_s, best = after, (perm_E, way)
    if best is None:
        return None
    return HomeOffer(tuple(best[0]), (now - best_s) / loads_SE.shape[0], best[1])


def relabelled(loads_SE: torch.Tensor, perm_E: list[int]) -> torch.Tensor:
    """``loads_SE`` under the order ``perm_E`` (new label ``j`` is old label ``perm_E[j]``)."""
    return loads_SE[:, torch.tensor(perm_E, dtype=torch.int64, device=loads_SE.device)]


def window_order(loads_SE: torch.Tensor, num_ranks: int) -> list[int] | None:
    """``perm_E``: :func:`popular_order` of the window's loads in labels (its groups kept
    on the ranks that own most of them), or ``None`` for an empty window and where it is
    the identity."""
    if loads_SE.shape[0] == 0:
        return None
    return _moved_order(loads_SE.sum(0), num_ranks)


def shared_order(loads_SE: torch.Tensor, num_ranks: int, num_slots: int) -> list[int] | None:
    """``perm_E``: :func:`popular_order` of each expert's share per holder, where the
    full slot budget (``R * B`` replicas) is given out as a table from empty slots gives
    it (``target.replica_counts``: its home one holder of ``n``, carrying ``1/n`` of its
    records); ``None`` for an empty window, no slot, and where it is the identity.

    :func:`window_order` spreads whole loads, as if no replica split them: a hot expert's
    home rank then gets the lightest companions, and once its replicas take most of its
    records that rank idles. Packing the shares, as EPLB packs replicas, balances the
    ranks the table will serve (module docstring: how each judgement weighs it)."""
    if loads_SE.shape[0] == 0 or num_slots == 0:
        return None
    totals_E = loads_SE.sum(0).cpu()
    n_E = replica_counts([int(t) for t in totals_E.tolist()], num_ranks, num_ranks * num_slots)
    return _moved_order(totals_E.double() / torch.tensor(n_E, dtype=torch.float64), num_ranks)


def _moved_order(load_E: torch.Tensor, num_ranks: int) -> list[int] | None:
    """:func:`popular_order` of ``load_E`` (``[E]``) from the labels' own order (its
    groups kept on the ranks that own most of them), or ``None`` where it is the identity."""
    identity = list(range(load_E.shape[0]))
    perm_E = popular_order(load_E, num_ranks, identity)
    return None if perm_E == identity else perm_E


def stale_offer(
    cost: StepCost,
    loads_SE: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    builds: Builds | None = None,
    now: StaleSteps | None = None,
) -> HomeOffer | None:
    """A re-home for steps whose slots go stale (training), held out: the
    :func:`window_order` of the window's older half, the seconds a step of its newer
    half saves under it and that half's way under it, with no slot kept either way
    (:func:`map_way`); ``None`` where there is no order or it saves nothing. An order
    scored on the steps it was fit to always looks faster, noise included; scored on
    later steps, only a popularity that lasts makes it so. ``now``: the labels' steps
    over the whole window, already scored as training steps (``stale_steps.stale_steps``
    with ``training``): their newer half is read, not scored again."""
    if now is not None and not now.training:
        raise ValueError("stale_offer weighs training steps: score now= with training=True")
    half = loads_SE.shape[0] // 2
    now_s = None if now is None else now.best(half)[0]
    return _stale_judged(cost, loads_SE[:half], loads_SE[half:], num_ranks, num_slots, builds,
                         now_s)  # fmt: skip


def _stale_judged(
    cost: StepCost,
    fit_SE: torch.Tensor,
    scored_SE: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    builds: Builds | None = None,
    now_s: float | None = None,
) -> HomeOffer | None:
    """The :func:`window_order` of the steps ``fit_SE``, the seconds a training step of
    ``scored_SE`` (its backward included) saves under it and those steps' way under it,
    with no slot kept either way (:func:`map_way`; ``now_s``: the labels' seconds of
    ``scored_SE`` where already scored); ``None`` where there is no order or it saves
    nothing."""
    perm_E = window_order(fit_SE, num_ranks)
    if perm_E is None:
        return None
    if now_s is None:
        now_s = map_way(cost, scored_SE, num_ranks, num_slots, builds, training=True)[0]
    moved_SE = relabelled(scored_SE, perm_E)
    after_s, way = map_way(cost, moved_SE, num_ranks, num_slots, builds, training=True)
    saving_s = (now_s - after_s) / scored_SE.shape[0]
    return HomeOffer(tuple(perm_E), saving_s, way, True) if saving_s > 0 else None
