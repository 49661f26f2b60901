"""The row layout of ``Plan.from_alloc``: a valid plan's ``PlanFields`` from any ``alloc [E, R]``.

Legend:
    R ranks, E experts, B slots, M = ceil(E/R), K = max(B, M) remote experts a rank
    may execute (its ``B`` slot rows plus ``max(0, M - B)`` direct rows)
    W = M + K rows per rank (the planner's row layout, unchanged)
    rep_ER    (e, r) is a replica: ``alloc[e, r] > 0`` and ``r`` is not ``e``'s home
    cand_RK   each rank's replicas, largest first (ties: lower id), ``-1`` padded

The layout is the planner's (``moonplan/plan/plan_type.py``), so a plan built
here runs on the runtime unchanged: home rows, then slots (largest replica
first, residents of ``previous`` keep their slot), then direct rows. That fixes
how many remote experts a rank may execute: ``K = max(B, M)``; an allocation
with more raises :class:`PlanError`. ``flow`` is all padding (no construction
record), ``target`` is ``alloc.sum(0)``.

:meth:`Plan.from_alloc` (in ``plan_type.py``) validates its input with
:func:`as_alloc` and :func:`check_remote` and builds the plan from these fields;
this module does not import ``plan_type``, so the two do not import each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moonplan.errors import PlanError
from moonplan.plan.home import home_list, home_map, home_of, max_local
from moonplan.plan.plan_fields import PlanFields, no_flows, padded_flows
from moonplan.plan.reference import place_slots, row_layout
from moonplan.plan.torch_layout import place_slots_host, place_slots_masked, row_layout_torch


def as_alloc(alloc: Any, counts_RE: torch.Tensor) -> torch.Tensor:
    """``alloc`` as int64 ``[E, R]`` on the counts' device, or a PlanError saying why not."""
    R, E = counts_RE.shape
    try:
        a = alloc if isinstance(alloc, torch.Tensor) else torch.as_tensor(alloc)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise PlanError(f"alloc must be an integer array [E, R]; cannot read it: {exc}") from None
    if a.dtype.is_floating_point or a.dtype.is_complex or a.dtype == torch.bool:
        raise PlanError(f"alloc must have an integer dtype, got {a.dtype}")
    if tuple(a.shape) != (E, R):
        raise PlanError(f"alloc must have shape [E, R] = {[E, R]}, got {list(a.shape)}")
    alloc_ER = a.to(device=counts_RE.device, dtype=torch.int64)
    if bool((alloc_ER < 0).any()):
        e, r = (int(v) for v in (alloc_ER < 0).nonzero()[0])
        raise PlanError(f"alloc must be non-negative: alloc[{e}, {r}] = {int(alloc_ER[e, r])}")
    got_E, want_E = alloc_ER.sum(1), counts_RE.sum(0)
    if not torch.equal(got_E, want_E):
        e = int((got_E != want_E).nonzero()[0])
        raise PlanError(
            f"alloc must conserve records: expert {e} is routed {int(want_E[e])} records "
            f"but alloc[{e}].sum() = {int(got_E[e])}"
        )
    return alloc_ER


def check_remote(alloc_ER: torch.Tensor, K: int) -> None:
    E, R = alloc_ER.shape
    home_E = home_map(E, R, device=alloc_ER.device)
    n_R = replicas(alloc_ER, home_E).sum(0)
    if bool((n_R > K).any()):
        r = int((n_R > K).nonzero()[0])
        raise PlanError(
            f"rank {r} executes {int(n_R[r])} remote experts; the row layout holds at most "
            f"max(slots, ceil(E/R)) = {K}"
        )


def replicas(alloc_ER: torch.Tensor, home_E: torch.Tensor) -> torch.Tensor:
    """``rep_ER`` bool ``[E, R]``: ``alloc > 0`` away from the expert's home."""
    r_R = torch.arange(alloc_ER.shape[1], device=alloc_ER.device)
    return (alloc_ER > 0) & (home_E[:, None] != r_R[None, :])


def layout_torch(
    alloc_ER: torch.Tensor,
    num_slots: int,
    align: int,
    prev_RB: torch.Tensor | None,
    *,
    host: bool | None = None,
) -> PlanFields:
    """Every Plan field but ``counts`` for ``alloc_ER`` (vectorised).

    The caller guarantees at most ``K = max(B, M)`` remote experts per rank. ``host``:
    order and place the replicas on the host (cheaper for CPU tensors); ``False``: masked
    tensor ops only, no host read on any device; ``None``: by the device.
    """
    E, R = alloc_ER.shape
    M = max_local(E, R)
    K = max(num_slots, M)
    host = alloc_ER.device.type == "cpu" if host is None else host
    home_E, ids_RM = home_layout(E, R, alloc_ER.device)
    rec_RE = torch.where(replicas(alloc_ER, home_E), alloc_ER, 0).t()
    cand_RK = _largest_first_host(rec_RE, K) if host else _largest_first_sort(rec_RE, K)
    prev = prev_RB if prev_RB is not None else cand_RK.new_full((R, num_slots), -1)
    place = place_slots_host if host else place_slots_masked
    slot_RB, new_RB, direct_RD = place(cand_RK, prev, num_slots)
    return layout_fields(alloc_ER, (home_E, ids_RM), (slot_RB, new_RB, direct_RD), align)


def largest_first(rec_RE: torch.Tensor, K: int) -> torch.Tensor:
    """``cand_RK`` int64: per row of ``rec_RE`` (int64 ``[R, E]``, ``>= 0``), the columns
    with records, most records first (ties: lower column), ``-1`` padded to ``K``.

    CPU tensors order only their nonzero entries on the host (:func:`_largest_first_host`:
    a few pairs per rank, where sorting every row costs ~0.5 ms at EP 64); any other
    device sorts every row (:func:`_largest_first_sort`, no host read).
    """
    if rec_RE.device.type == "cpu":
        return _largest_first_host(rec_RE, K)
    return _largest_first_sort(rec_RE, K)


def _largest_first_sort(rec_RE: torch.Tensor, K: int) -> torch.Tensor:
    """:func:`largest_first` by a stable descending sort of each row (any device)."""
    R = rec_RE.shape[0]
    rec_RE, order_RE = torch.sort(rec_RE, dim=1, descending=True, stable=True)
    cand_RK = torch.where(rec_RE > 0, order_RE, -1)[:, :K]
    if cand_RK.shape[1] < K:
        cand_RK = torch.cat([cand_RK, cand_RK.new_full((R, K - cand_RK.shape[1]), -1)], 1)
    return cand_RK


def _largest_first_host(rec_RE: torch.Tensor, K: int) -> torch.Tensor:
    """:func:`largest_first` of a CPU tensor: its nonzero entries ordered by (row, most
    records, lowest column) and placed by their rank within the row."""
    rec = rec_RE.numpy()
    R = rec.shape[0]
    r_N, e_N = rec.nonzero()
    order_N = np.lexsort((e_N, -rec[r_N, e_N], r_N))  # the last key sorts first
    r_N, e_N = r_N[order_N], e_N[order_N]
    at_N = np.arange(len(r_N)) - np.searchsorted(r_N, r_N)  # place within its row
    fits_N = at_N < K
    cand_RK = np.full((R, K), -1, dtype=np.int64)
    cand_RK[r_N[fits_N], at_N[fits_N]] = e_N[fits_N]
    return torch.from_numpy(cand_RK)


def layout_resident(
    alloc_ER: torch.Tensor, num_slots: int, align: int, prev_RB: torch.Tensor | None
) -> PlanFields:
    """:func:`layout_torch` for an allocation whose replicas all sit in ``prev_RB``'s slots.

    Then nothing moves: the slots are ``previous``'s, no slot is new and nothing is
    direct (static and resident plans), so the slot placement is skipped.
    """
    E, R = alloc_ER.shape
    slot_RB = prev_RB if prev_RB is not None else alloc_ER.new_full((R, num_slots), -1)
    direct_RD = alloc_ER.new_full((R, max(0, max_local(E, R) - num_slots)), -1)
    slots = (slot_RB, torch.zeros_like(slot_RB), direct_RD)
    return layout_fields(alloc_ER, home_layout(E, R, alloc_ER.device), slots, align)


def home_layout(
    num_experts: int, num_ranks: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(home_E, ids_RM)``: :func:`~moonplan.plan.home.home_map` and the experts of each
    home group (``E`` where it has fewer than ``M``), int64 on ``device``, from one
    ``arange`` of the experts in few kernels (the general formulas take about 19).

    The first ``E mod R`` ranks own ``M`` experts, the others ``M - 1`` (or all ``M``
    when ``R`` divides ``E``): the home rows are the experts in order, the short
    groups padded with ``E``.
    """
    E, R = num_experts, num_ranks
    base, extra = divmod(E, R)
    M = max_local(E, R)
    e_E = torch.arange(E, dtype=torch.int64, device=device)
    if extra == 0:  # 2 kernels
        return home_of(e_E, E, R), e_E.view(R, M)
    cut = extra * M  # experts of the full groups
    short = torch.nn.functional.pad(e_E[cut:].view(R - extra, base), (0, 1), value=E)
    ids_RM = torch.cat([e_E[:cut].view(extra, M), short], 0)
    return home_of(e_E, E, R), ids_RM


def layout_fields(
    alloc_ER: torch.Tensor,
    homes: tuple[torch.Tensor, torch.Tensor],
    slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    align: int,
    *,
    target_R: torch.Tensor | None = None,
    flow_F3: torch.Tensor | None = None,
) -> PlanFields:
    """The plan fields of ``alloc_ER``: ``homes = (home_E, ids_RM)`` from :func:`home_layout`,
    ``slots = (slot_RB, new_RB, direct_RD)`` the slots, ``slot_new`` and direct replicas,
    the rows laid out on the allocation's device. ``target_R``: the planner's targets
    (default ``alloc_ER.sum(0)``); ``flow_F3``: its flows (default: all padding, no
    construction record)."""
    R, dev = alloc_ER.shape[1], alloc_ER.device
    (home_E, ids_RM), (slot_RB, new_RB, direct_RD) = homes, slots
    row_RW, count_RW, offset_RW1 = row_layout_torch(ids_RM, slot_RB, direct_RD, alloc_ER, align)
    return PlanFields(
        alloc=alloc_ER,
        target=alloc_ER.sum(0) if target_R is None else target_R,
        home=home_E,
        flow=no_flows(R, dev) if flow_F3 is None else flow_F3,
        slot_expert=slot_RB,
        slot_new=new_RB,
        row_expert=row_RW,
        row_count=count_RW,
        row_offset=offset_RW1,
    )


def layout_reference(
    counts_RE: torch.Tensor,
    alloc_ER: torch.Tensor,
    num_slots: int,
    align: int,
    prev_RB: torch.Tensor | None,
) -> PlanFields:
    """:func:`layout_torch` in plain Python (the readable definition)."""
    E, R = alloc_ER.shape
    alloc = alloc_ER.tolist()
    home = home_list(E, R)
    prev = None if prev_RB is None else prev_RB.tolist()
    rows: dict[str, list] = {k: [] for k in ("slot_expert", "slot_new", "rows", "count", "off")}
    for r in range(R):
        reps = [(e, alloc[e][r]) for e in range(E) if alloc[e][r] > 0 and home[e] != r]
        slot, new, direct = place_slots(reps, None if prev is None else prev[r], num_slots)
        row, count, off = row_layout(r, alloc, E, R, num_slots, slot, direct, align)
        for k, v in zip(rows, (slot, new, row, count, off), strict=True):
            rows[k].append(v)
    dev = counts_RE.device

    def t(x: list, *shape: int) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=dev).reshape(shape)

    W = max_local(E, R) + max(num_slots, max_local(E, R))
    return PlanFields(
        alloc=t(alloc, E, R),
        target=t([sum(alloc[e][r] for e in range(E)) for r in range(R)], R),
        home=t(home, E),
        flow=padded_flows([], R, dev),
        slot_expert=t(rows["slot_expert"], R, num_slots),
        slot_new=t(rows["slot_new"], R, num_slots),
        row_expert=t(rows["rows"], R, W),
        row_count=t(rows["count"], R, W),
        row_offset=t(rows["off"], R, W + 1),
    )
