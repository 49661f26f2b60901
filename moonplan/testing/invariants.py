"""``check_plan``: verify a :class:`Plan` against the invariants of ``moonplan/plan/README.md``.

Legend: R ranks, E experts, B slots, M = ceil(E/R), K = max(B, M), W = M + K rows per rank.

Two levels: ``strict=True`` checks moonplan's own construction (the flow record,
at most ``M`` remote experts) and exact balance for ``policy="exact"`` plans;
``strict=False`` checks only what any policy's plan must meet to run
(``docs/planner-policy.md``).

Raises :class:`PlanError` naming the first broken invariant and where it breaks.
Works on any device (it reads the plan on the host).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moonplan.errors import PlanError
from moonplan.plan.home import home_map, max_local, targets_list
from moonplan.plan.plan_type import PLAN_TENSORS, Plan
from moonplan.plan.validate import as_counts


def check_plan(
    plan: Plan, counts: Any, *, previous: Plan | None = None, strict: bool = True
) -> None:
    """Raise :class:`PlanError` unless ``plan`` is a correct plan for ``counts``.

    Args:
        plan: the plan to verify.
        counts: ``[R, E]`` the counts it was made from.
        previous: the ``previous=`` plan it was made with, if any (then free
            slots may keep residents of ``previous``; otherwise every filled
            slot must hold an expert executed this step).
        strict: ``True``: moonplan's construction (below); ``False``: only the
            policy-agnostic invariants, for a plan of any policy
            (e.g. ``Plan.from_alloc``).

    Always checked: shapes and home map; 1 conservation (``alloc >= 0``, row
    sums equal expert totals); the loads (``alloc.sum(0) == target``, every load
    at most ``plan.load_bound``); 4 slots (every replica in a slot or direct,
    direct only when slots are full, no home expert or duplicate in slots,
    ``slot_new`` marks exactly the fills); the row layout and padded offsets;
    at most ``K = max(B, M)`` remote experts per rank (what the rows hold).

    ``strict=True`` also checks: 2 exact balance for ``plan.policy == "exact"``
    (targets ``N//R`` plus remainder; other policies are held to their declared
    ``load_bound``); 3 at most ``M`` remote experts per rank; the flow record
    (one donor group per receiver, matching the allocation), unless the plan has
    none (all padding) and is not ``exact``: static, resident and
    ``from_alloc`` plans record no flows.
    """
    counts_RE = as_counts(counts).cpu()
    p = _host(plan)
    R, E = counts_RE.shape
    _check_shapes(p, R, E)
    _check_conservation(p, counts_RE)
    if strict and p.policy == "exact":
        _check_balance(p, counts_RE)
    else:
        _check_bound(p)
    _check_remote_bound(p, p.max_local if strict else max(p.num_slots, p.max_local))
    if strict and (p.policy == "exact" or bool((p.flow[:, 0] >= 0).any())):
        _check_flows(p)
    _check_slots(p, None if previous is None else previous.slot_expert.cpu())
    _check_rows(p)


def _fail(invariant: str, detail: str) -> None:
    raise PlanError(f"plan breaks {invariant}: {detail}")


def _host(plan: Plan) -> Plan:
    if not isinstance(plan, Plan):
        raise PlanError(f"expected a moonplan Plan, got {type(plan).__name__}")
    fields = {k: getattr(plan, k).cpu() for k in PLAN_TENSORS}
    return dataclasses.replace(plan, **fields)


def _check_shapes(p: Plan, R: int, E: int) -> None:
    B, M = p.num_slots, max_local(E, R)
    W = M + max(B, M)
    want = {
        "counts": (R, E),
        "alloc": (E, R),
        "target": (R,),
        "home": (E,),
        "flow": (max(R - 1, 0), 3),
        "slot_expert": (R, B),
        "slot_new": (R, B),
        "row_expert": (R, W),
        "row_count": (R, W),
        "row_offset": (R, W + 1),
    }
    for name, shape in want.items():
        t = getattr(p, name)
        if tuple(t.shape) != shape or t.dtype != torch.int64:
            _fail(
                "its shape contract", f"{name} is {t.dtype}{tuple(t.shape)}, expected int64{shape}"
            )
    if not torch.equal(p.home, home_map(E, R)):
        _fail("the home map", f"home = {p.home.tolist()}, expected {home_map(E, R).tolist()}")


def _check_conservation(p: Plan, counts_RE: torch.Tensor) -> None:
    if not torch.equal(p.counts, counts_RE):
        _fail("its input", "plan.counts differs from the counts given to check_plan")
    if bool((p.alloc < 0).any()):
        e, r = (int(v) for v in (p.alloc < 0).nonzero()[0])
        _fail("invariant 1 (alloc >= 0)", f"alloc[{e}, {r}] = {int(p.alloc[e, r])}")
    got_E, want_E = p.alloc.sum(1), counts_RE.sum(0)
    if not torch.equal(got_E, want_E):
        e = int((got_E != want_E).nonzero()[0])
        _fail(
            "invariant 1 (no record lost or invented)",
            f"expert {e} is routed {int(want_E[e])} records but the plan executes {int(got_E[e])}",
        )


def _check_balance(p: Plan, counts_RE: torch.Tensor) -> None:
    R = counts_RE.shape[0]
    want_R = torch.tensor(targets_list(int(counts_RE.sum()), R), dtype=torch.int64)
    if not torch.equal(p.target, want_R):
        _fail("invariant 2 (targets)", f"target = {p.target.tolist()}, expected {want_R.tolist()}")
    got_R = p.alloc.sum(0)
    if not torch.equal(got_R, want_R):
        r = int((got_R != want_R).nonzero()[0])
        _fail(
            "invariant 2 (exact balance)",
            f"rank {r} executes {int(got_R[r])} records, target {int(want_R[r])}",
        )


def _check_bound(p: Plan) -> None:
    """Loads of any policy: ``target`` is the load, and no load exceeds the declared bound."""
    got_R = p.alloc.sum(0)
    if not torch.equal(p.target, got_R):
        r = int((p.target != got_R).nonzero()[0])
        _fail("its loads", f"rank {r} executes {int(got_R[r])} records, target {int(p.target[r])}")
    bound = p.load_bound
    if got_R.numel() and int(got_R.max()) > bound:
        r = int(got_R.argmax())
        _fail(
            "its declared load bound",
            f"rank {r} executes {int(got_R[r])} records, load_bound {bound} (policy {p.policy!r})",
        )


def _check_remote_bound(p: Plan, bound: int) -> None:
    remote_R = p.remote_experts()
    if bool((remote_R > bound).any()):
        r = int((remote_R > bound).nonzero()[0])
        what = (
            "invariant 3 (at most ceil(E/R) remote experts per rank)"
            if bound == p.max_local
            else "the row layout (at most max(slots, ceil(E/R)) remote experts per rank)"
        )
        _fail(what, f"rank {r} executes {int(remote_R[r])} remote experts, bound {bound}")


def _check_flows(p: Plan) -> None:
    """The recorded group flows are the allocation's: one donor group per receiver."""
    R = p.num_ranks
    flows = [tuple(f) for f in p.flow.tolist()]
    n = sum(f[0] >= 0 for f in flows)
    if any(f != (-1, -1, 0) for f in flows[n:]):
        _fail("the flow record", f"padding must follow the {n} flows: {flows}")
    got = torch.zeros(R, R, dtype=torch.int64)
    for d, r, q in flows[:n]:
        if not (0 <= d < R and 0 <= r < R and d != r and q > 0) or bool(got[:, r].any()):
            _fail("the flow record", f"flow ({d}, {r}, {q}) is invalid or fills rank {r} twice")
        got[d, r] = q
    want = torch.zeros(R, R, dtype=torch.int64).index_add_(0, p.home, p.alloc)
    want.fill_diagonal_(0)
    if not torch.equal(got, want):
        _fail("the flow record", "the flows differ from the records each group sends each rank")


def _check_slots(p: Plan, prev_slot_RB: torch.Tensor | None) -> None:
    E, B = p.num_experts, p.num_slots
    replica_ER = p.replica_mask()
    direct_RD = p.direct_expert()
    for r in range(p.num_ranks):
        slots = p.slot_expert[r].tolist()
        held = [e for e in slots if e != -1]
        if any(e < -1 or e >= E for e in slots):
            _fail("invariant 4 (slots)", f"rank {r} slot ids out of range: {slots}")
        if len(set(held)) != len(held):
            _fail("invariant 4 (slots)", f"rank {r} holds an expert twice: {slots}")
        homes = [e for e in held if int(p.home[e]) == r]
        if homes:
            _fail("invariant 4 (slots)", f"rank {r} holds its home expert {homes[0]} in a slot")
        used = set(replica_ER[:, r].nonzero().flatten().tolist())
        direct = [e for e in direct_RD[r].tolist() if e != -1]
        if set(held) & used | set(direct) != used or len(set(direct)) != len(direct):
            _fail(
                "invariant 4 (every replica in a slot or direct)",
                f"rank {r} executes remote experts {sorted(used)}, slots {slots}, direct {direct}",
            )
        if set(direct) & set(held):
            _fail("invariant 4 (slots)", f"rank {r} marks a slotted expert direct: {direct}")
        if direct and not all(e in used for e in slots):
            _fail(
                "invariant 4 (direct only when slots are full)",
                f"rank {r}: slots {slots}, direct {direct}",
            )
        prev = [-1] * B if prev_slot_RB is None else prev_slot_RB[r].tolist()
        _check_residents(r, slots, prev, used, p.slot_new[r].tolist())


def _check_residents(
    r: int, slots: list[int], prev: list[int], used: set[int], new: list[int]
) -> None:
    for j, e in enumerate(slots):
        resident = e != -1 and prev[j] == e
        if e != -1 and e not in used and not resident:
            _fail(
                "invariant 4 (slots)",
                f"rank {r} slot {j} holds expert {e}, neither used nor resident",
            )
        want_new = int(e != -1 and not resident)
        if new[j] != want_new:
            _fail(
                "invariant 4 (slot_new)",
                f"rank {r} slot {j}: slot_new {new[j]}, expected {want_new}",
            )


def _check_rows(p: Plan) -> None:
    R, E, B, M = p.num_ranks, p.num_experts, p.num_slots, p.max_local
    for r in range(R):
        rows = p.row_expert[r].tolist()
        home = (p.home == r).nonzero().flatten().tolist()
        if rows[: len(home)] != home or any(e != -1 for e in rows[len(home) : M]):
            _fail("the row layout", f"rank {r} home rows {rows[:M]}, expected {home} then -1")
        if rows[M : M + B] != p.slot_expert[r].tolist():
            _fail("the row layout", f"rank {r} slot rows differ from slot_expert")
        direct = rows[M + B :]
        n = sum(e != -1 for e in direct)
        if any(e != -1 for e in direct[n:]):
            _fail("the row layout", f"rank {r} direct rows not packed: {direct}")
        want = [int(p.alloc[e, r]) if e >= 0 else 0 for e in rows]
        if p.row_count[r].tolist() != want:
            _fail(
                "the row layout", f"rank {r} row_count {p.row_count[r].tolist()}, expected {want}"
            )
        if any(
            0 <= e < E and int(p.alloc[e, r]) == 0 and not M <= i < M + B
            for i, e in enumerate(rows)
        ):
            pass  # home rows may be empty; direct rows never are (checked via `used` above)
        off = [0]
        for c in want:
            off.append(off[-1] + -(-c // p.align) * p.align)
        if p.row_offset[r].tolist() != off:
            _fail(
                "the row layout", f"rank {r} row_offset {p.row_offset[r].tolist()}, expected {off}"
            )
