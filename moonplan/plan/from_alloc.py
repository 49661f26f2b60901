"""``Plan.from_alloc``: a valid :class:`Plan` from any allocation ``alloc [E, R]``.

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
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.errors import PlanError
from moonplan.plan.home import home_list, home_map, max_local
from moonplan.plan.plan_type import Plan, Predicted, make_plan
from moonplan.plan.reference import place_slots, row_layout
from moonplan.plan.torch_layout import group_experts, place_slots_torch, row_layout_torch
from moonplan.plan.validate import as_counts, check_options


def from_alloc(
    counts: Any,
    alloc: Any,
    *,
    slots: int | None = None,
    align: int = 1,
    previous: Plan | None = None,
    policy: str = "custom",
    load_bound: int | None = None,
    backend: str = "torch",
) -> Plan:
    """A valid plan that executes ``alloc`` (validated on the host).

    Args:
        counts: ``[R, E]`` non-negative integer router counts.
        alloc: ``[E, R]`` non-negative integers with ``alloc[e].sum() == counts[:, e].sum()``;
            at most ``K = max(B, M)`` remote experts per rank.
        slots: ``B`` (default ``M``), align: row padding, previous: as in :func:`moonplan.plan`.
        policy: the name recorded in ``plan.policy``.
        load_bound: the declared bound on every rank's load (default: the largest load);
            must be at least the largest load.
        backend: ``"torch"`` (vectorised, the default) or ``"reference"`` (plain Python);
            both give the same plan bit for bit.

    Raises:
        PlanError: naming the broken requirement (shape, dtype, negative entry,
            conservation, too many remote experts on a rank, bound, options).
    """
    counts_RE = as_counts(counts)
    R, E = counts_RE.shape
    B = check_options(slots, align, max_local(E, R))
    alloc_ER = _as_alloc(alloc, counts_RE)
    prev_RB = previous_slots(previous, R, E, B, counts_RE.device)
    _check_remote(alloc_ER, max(B, max_local(E, R)))
    if not isinstance(policy, str) or not policy:
        raise PlanError(f"policy must be a non-empty string, got {policy!r}")
    top = int(alloc_ER.sum(0).max())
    if load_bound is not None and (not isinstance(load_bound, int) or load_bound < top):
        raise PlanError(f"load_bound {load_bound!r} is below the largest load {top}")
    if backend == "reference":
        fields = layout_reference(counts_RE, alloc_ER, B, align, prev_RB)
    elif backend == "torch":
        fields = layout_torch(alloc_ER, B, align, prev_RB)
    else:
        raise PlanError(f"from_alloc backend must be 'torch' or 'reference', got {backend!r}")
    return make_plan(
        fields,
        counts=counts_RE,
        num_slots=B,
        align=align,
        backend=backend,
        policy=policy,
        predicted=Predicted(),
        planned=0,
        declared_bound=top if load_bound is None else load_bound,
    )


def previous_slots(
    previous: Plan | None, R: int, E: int, B: int, device: torch.device
) -> torch.Tensor | None:
    """``previous``'s slots ``[R, B]`` on ``device`` after a shape check, or ``None``."""
    if previous is None:
        return None
    if not isinstance(previous, Plan):
        raise PlanError(f"previous must be a moonplan Plan, got {type(previous).__name__}")
    if (previous.num_ranks, previous.num_experts, previous.num_slots) != (R, E, B):
        raise PlanError(
            "previous plan has (R, E, B) = "
            f"{(previous.num_ranks, previous.num_experts, previous.num_slots)}, "
            f"this call has {(R, E, B)}"
        )
    return previous.slot_expert.to(device)


def _as_alloc(alloc: Any, counts_RE: torch.Tensor) -> torch.Tensor:
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


def _check_remote(alloc_ER: torch.Tensor, K: int) -> None:
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
    alloc_ER: torch.Tensor, num_slots: int, align: int, prev_RB: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Every Plan field but ``counts`` for ``alloc_ER`` (vectorised, no host read).

    The caller guarantees at most ``K = max(B, M)`` remote experts per rank.
    """
    E, R = alloc_ER.shape
    dev = alloc_ER.device
    M = max_local(E, R)
    K = max(num_slots, M)
    home_E = home_map(E, R, device=dev)
    rec_RE = torch.where(replicas(alloc_ER, home_E), alloc_ER, 0).t()
    rec_RE, order_RE = torch.sort(rec_RE, dim=1, descending=True, stable=True)
    cand_RK = torch.where(rec_RE > 0, order_RE, -1)[:, :K]
    if cand_RK.shape[1] < K:
        cand_RK = torch.cat([cand_RK, cand_RK.new_full((R, K - cand_RK.shape[1]), -1)], 1)
    prev = prev_RB if prev_RB is not None else cand_RK.new_full((R, num_slots), -1)
    slot_RB, new_RB, direct_RD = place_slots_torch(cand_RK, prev, num_slots)
    row_RW, count_RW, offset_RW1 = row_layout_torch(
        group_experts(E, R, dev), slot_RB, direct_RD, alloc_ER, align
    )
    F = max(R - 1, 0)
    return {
        "alloc": alloc_ER,
        "target": alloc_ER.sum(0),
        "home": home_E,
        "flow": torch.tensor([[-1, -1, 0]], dtype=torch.int64, device=dev).expand(F, 3).clone(),
        "slot_expert": slot_RB,
        "slot_new": new_RB,
        "row_expert": row_RW,
        "row_count": count_RW,
        "row_offset": offset_RW1,
    }


def layout_reference(
    counts_RE: torch.Tensor,
    alloc_ER: torch.Tensor,
    num_slots: int,
    align: int,
    prev_RB: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
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
    F = max(R - 1, 0)
    return {
        "alloc": t(alloc, E, R),
        "target": t([sum(alloc[e][r] for e in range(E)) for r in range(R)], R),
        "home": t(home, E),
        "flow": t([[-1, -1, 0]] * F, F, 3),
        "slot_expert": t(rows["slot_expert"], R, num_slots),
        "slot_new": t(rows["slot_new"], R, num_slots),
        "row_expert": t(rows["rows"], R, W),
        "row_count": t(rows["count"], R, W),
        "row_offset": t(rows["off"], R, W + 1),
    }
