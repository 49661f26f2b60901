"""Plans over a given slot table without a planner call: static EP's, and the lookup.

Legend:
    R ranks    E experts    B slots per rank
    slot_RB    int64 ``[R, B]`` the expert in each slot (``-1``: empty)

A refill copies experts into slots beside the steps; once every copy has arrived, the
next step plans with ``previous=`` a plan whose slots are the refilled ones. Only the
slots (and the flows, none here) of ``previous`` are read, so the serving plan is static
EP's allocation laid out over those slots: nothing is new, nothing is direct.

Where planner calls do not pay (``Decisions.serve``), ``auto`` serves a lookup plan
(:func:`lookup_plan`), a fixed rule from expert to ranks, as a placement like EPLB's
serves, in one of three ways (:data:`LOOKUPS`, and :data:`WEIGHTED`):

* ``placed``: each expert's records on the first rank holding it resident away from its
  home, else on its home (the ``placed`` candidate: whole moves);
* ``split``: each expert's records split evenly over its holders, its home and the ranks
  holding it resident, in rank order (the first ``T mod n`` take one more), as EPLB
  splits an expert over its replicas;
* ``weighted``: each expert's records split over its holders in fixed proportions, the
  weights its decision fit to the window's mean step (``shares.table_shares``: the least
  loaded holder first) and keeps beside its verdict, so the proportions are the
  decision's and each step's own totals are split by them (``shares.weighted_alloc``).

Over empty slots all three are static EP.
"""

from __future__ import annotations

import torch

from moonplan.errors import PlanError
from moonplan.plan.choice.tensor import placed_torch
from moonplan.plan.from_alloc import layout_resident
from moonplan.plan.home import home_map
from moonplan.plan.placement import static_alloc
from moonplan.plan.plan_type import Plan, make_plan
from moonplan.plan.residency.shares import SHARE_SCALE, Shares, holders, weighted_alloc
from moonplan.plan.torch_backend import resident_map


def empty_slots(
    num_ranks: int, num_slots: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """int64 ``[R, B]``: a slot table with every slot empty (``-1``), on ``device``."""
    return torch.full((num_ranks, num_slots), -1, dtype=torch.int64, device=device)


def serving_plan(
    counts_RE: torch.Tensor, slot_RB: torch.Tensor, *, align: int = 1, check: bool = True
) -> Plan:
    """A valid plan of ``counts_RE`` (int64 ``[R, E]``) whose slots are ``slot_RB``.
    ``check=False`` skips :func:`check_slots` (a host read) for slots taken from a valid
    plan.

    Raises:
        PlanError: ``slot_RB`` is not ``[R, B]``, names an expert out of range, holds an
            expert twice on one rank or a rank's own home expert.
    """
    slot_RB = _slots(counts_RE, slot_RB, check)
    return _over_slots(counts_RE, static_alloc(counts_RE), slot_RB, align, "static")


LOOKUPS = ("placed", "split")
"""The lookup plans, in tie-break order (module docstring)."""


def lookup_plan(
    counts_RE: torch.Tensor,
    slot_RB: torch.Tensor,
    how: str = "placed",
    *,
    align: int = 1,
    check: bool = True,
) -> Plan:
    """The lookup plan ``how`` (one of :data:`LOOKUPS`) of ``counts_RE`` (int64 ``[R, E]``)
    over the slots ``slot_RB`` (module docstring; arguments and errors as
    :func:`serving_plan`'s). No host read with ``check=False``."""
    slot_RB = _slots(counts_RE, slot_RB, check)
    alloc_ER = lookup_alloc(how, counts_RE.sum(0), resident_map(slot_RB, counts_RE.shape[1]))
    return _over_slots(counts_RE, alloc_ER, slot_RB, align, how)


WEIGHTED = "weighted"
"""The weighted lookup (module docstring): served with its ``shares.Shares``."""


def weighted_plan(
    counts_RE: torch.Tensor,
    slot_RB: torch.Tensor,
    shares: Shares,
    *,
    align: int = 1,
    check: bool = True,
) -> Plan:
    """The weighted lookup's plan of ``counts_RE`` over ``slot_RB`` with a decision's
    ``shares`` (``shares.Shares``, on the counts' device), no planner call and, with
    ``check=False``, no host read. Where the slots changed since the shares were fit
    (calls or the exact kernel served meanwhile), a weight on a rank that no longer holds
    the expert counts 0 (the others keep their proportions: on the real prefill-l3 trace
    this ran 5% faster than splitting such experts evenly), and an expert with no weight
    left splits evenly over its holders now. Weights are clamped to ``[0, SHARE_SCALE]``
    (``T * SHARE_SCALE * R`` bounds the int64 products): the plan is valid for any
    weights (arguments and errors otherwise as :func:`serving_plan`'s)."""
    slot_RB = _slots(counts_RE, slot_RB, check)
    hold_ER = holders(resident_map(slot_RB, counts_RE.shape[1]))
    w_ER = torch.where(hold_ER, shares.weight_ER.to(torch.int64).clamp(0, SHARE_SCALE), 0)
    w_ER = torch.where(w_ER.sum(1, keepdim=True) > 0, w_ER, hold_ER.to(torch.int64))
    alloc_ER = weighted_alloc(counts_RE.sum(0), w_ER)
    return _over_slots(counts_RE, alloc_ER, slot_RB, align, WEIGHTED)


def lookup_way(
    counts_RE: torch.Tensor,
    slot_RB: torch.Tensor,
    how: str,
    shares: Shares | None,
    *,
    align: int = 1,
    check: bool = True,
) -> Plan:
    """The plan of the lookup way ``how`` over ``slot_RB``: :func:`weighted_plan` with
    ``shares`` for :data:`WEIGHTED`, else :func:`lookup_plan` (the one dispatch the
    runtime's ``Balancer.serve`` and the simulator's ``moonplan-auto`` share).

    Raises:
        ValueError: ``how`` is the weighted lookup and ``shares`` is ``None``.
    """
    if how != WEIGHTED:
        return lookup_plan(counts_RE, slot_RB, how, align=align, check=check)
    if shares is None:
        raise ValueError("the weighted lookup is served with its decision's shares")
    return weighted_plan(counts_RE, slot_RB, shares, align=align, check=check)


def _slots(counts_RE: torch.Tensor, slot_RB: torch.Tensor, check: bool) -> torch.Tensor:
    """``slot_RB`` as int64 on the counts' device, checked (:func:`check_slots`) unless
    ``check`` is false."""
    slot_RB = slot_RB.to(device=counts_RE.device, dtype=torch.int64)
    if check:
        check_slots(slot_RB, *counts_RE.shape)
    return slot_RB


def _over_slots(
    counts_RE: torch.Tensor, alloc_ER: torch.Tensor, slot_RB: torch.Tensor, align: int, policy: str
) -> Plan:
    """The plan of ``alloc_ER`` laid out over the slots ``slot_RB``: nothing new, nothing
    direct (``from_alloc.layout_resident``), named ``policy``, no planner call."""
    fields = layout_resident(alloc_ER, slot_RB.shape[1], align, slot_RB)
    return make_plan(fields, counts=counts_RE, num_slots=slot_RB.shape[1], align=align,
                     backend="torch", policy=policy, planned=0)  # fmt: skip


def lookup_alloc(how: str, T_E: torch.Tensor, resident_ER: torch.Tensor) -> torch.Tensor:
    """int64 ``[E, R]``: lookup ``how``'s allocation of the records per expert ``T_E``
    over the resident pairs (bool ``resident_ER``); no host read (``torch.vmap``-able)."""
    E, R = resident_ER.shape
    home_E = home_map(E, R, T_E.device)
    if how == "placed":
        return placed_torch(T_E, resident_ER, home_E)
    if how != "split":
        raise ValueError(f"lookup must be one of {LOOKUPS}, got {how!r}")
    hold_ER = holders(resident_ER)
    n_E = hold_ER.sum(1)  # >= 1: the home
    index_ER = torch.cumsum(hold_ER.to(torch.int64), 1) - 1  # place among the holders
    share_ER = (T_E // n_E)[:, None] + (index_ER < (T_E % n_E)[:, None]).to(torch.int64)
    return torch.where(hold_ER, share_ER, 0)


def check_slots(slot_RB: torch.Tensor, R: int, E: int) -> None:
    """A slot table's invariants (invariant 4 of ``docs/design.md``), or ``PlanError``."""
    if slot_RB.dim() != 2 or slot_RB.shape[0] != R:
        raise PlanError(f"slots must be [R={R}, B], got {tuple(slot_RB.shape)}")
    rows = slot_RB.cpu().tolist()
    home = home_map(E, R).tolist()
    for r, row in enumerate(rows):
        held = [e for e in row if e != -1]
        if any(not 0 <= e < E for e in held):
            raise PlanError(f"rank {r}'s slots {row} name an expert outside 0..{E - 1}")
        if len(set(held)) != len(held):
            raise PlanError(f"rank {r}'s slots {row} hold an expert twice")
        if any(home[e] == r for e in held):
            raise PlanError(f"rank {r}'s slots {row} hold one of its own home experts")
