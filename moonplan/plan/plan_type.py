"""The :class:`Plan` object shared by every planner backend.

Legend:
    R  ranks            E  experts          B  prefetch slots per rank
    M  ceil(E/R)        W  rows per rank = M + max(B, M)

Row layout of rank ``r`` (the grouped-GEMM row order, and the order of its
expert-grouped receive buffer):

* rows ``[0, M)``: its home experts in id order, then ``-1`` padding;
* rows ``[M, M+B)``: its ``B`` prefetch slots (``slot_expert[r]``);
* rows ``[M+B, W)``: replicas beyond ``B`` (``direct``: read in place from
  the home rank's weights), then ``-1`` padding.

``row_offset[r]`` are the ``align``-padded cumulative offsets (cu_seqlens) of
the rows in the receive buffer; empty rows take no space.

``policy``, ``predicted``, ``planned``, ``choice`` and ``load_bound`` say how the
allocation was chosen (``docs/planner-policy.md``); every policy's plan has this layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from moonplan.errors import PlanError
from moonplan.plan.from_alloc import as_alloc, check_remote, layout_reference, layout_torch
from moonplan.plan.home import max_local
from moonplan.plan.placement import static_load
from moonplan.plan.plan_fields import PlanFields
from moonplan.plan.validate import check_options, check_previous, checked_counts

PLAN_TENSORS = ("counts", *PlanFields._fields)
"""Names of a :class:`Plan`'s tensor fields: ``counts`` and :class:`PlanFields`' (every
backend produces all but ``counts``)."""


class Predicted(Mapping[str, float]):
    """A read-only, picklable mapping ``candidate name -> predicted step seconds``.

    Iterates in the order the candidates were evaluated.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, float] | None = None) -> None:
        self._items: tuple[tuple[str, float], ...] = tuple((items or {}).items())

    def __getitem__(self, key: str) -> float:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Predicted({dict(self._items)!r})"


@dataclass(frozen=True, eq=False)
class Choice:
    """How ``policy="auto"`` chose a plan (``moonplan.plan.choice``).

    The tensors stay on the plan's device: the planner reads nothing on the host, and
    each accessor below reads them when asked (one synchronisation on a GPU).

    Attributes:
        names: the candidates in table order (``moonplan.plan.choice.table``).
        index: int64 0-d, the winner's position in ``names``.
        scores: float64 ``[C]``, each candidate's predicted step seconds (``inf``: not
            scored, because the early exit showed static EP wins).
        exited: bool 0-d, the early exit was taken (only static EP was scored).
        credit: float64 0-d, seconds of rent accrued since the last buy, read by the next
            step's choice (``moonplan.plan.choice.rent``).
        pending: float64 0-d, the most seconds the steps since the last full call could
            have saved with it, read by the next step's early exit (``rent.exit_rent``);
            0 when nothing reads it (a choice made without ``previous``'s).
        rounds: int64 0-d, the rounds this call's ``resident`` build ran in its
            roundings together: the early exit's where it built one; in a full call where
            it did not, the full call's own; 0 where the exit was taken without it.
            ``StepCost.round_s`` charges each, beside the exit's test or the full call
            (``rent.exit_rounds_s``, ``rent.call_rounds_s``).
    """

    names: tuple[str, ...]
    index: torch.Tensor
    scores: torch.Tensor
    exited: torch.Tensor
    credit: torch.Tensor
    pending: torch.Tensor
    rounds: torch.Tensor

    def name(self) -> str:
        """The chosen candidate's name (host read)."""
        return self.names[int(self.index)]

    def predicted(self) -> Predicted:
        """``candidate -> predicted seconds`` of the candidates scored (host read)."""
        values = self.scores.tolist()
        return Predicted({n: v for n, v in zip(self.names, values, strict=True) if v < math.inf})

    def early_exit(self) -> bool:
        """Whether the early exit was taken (host read)."""
        return bool(self.exited)

    def built_resident(self) -> bool:
        """Whether the exit was taken with the ``resident`` candidate built (it is scored
        there; a full call scores every candidate; host read)."""
        return (
            bool(self.exited)
            and "resident" in self.names
            and math.isfinite(float(self.scores[self.names.index("resident")]))
        )

    def to(self, device: torch.device) -> Choice:
        """The same choice with its tensors on ``device``."""
        held = (self.index, self.scores, self.exited, self.credit, self.pending, self.rounds)
        return Choice(self.names, *(t.to(device) for t in held))


@dataclass(frozen=True, eq=False)
class Plan:
    """An allocation of routed records to ranks (immutable); exactly balanced by default.

    All tensors are int64 and live on the device of the ``counts`` that made
    them; their shapes depend only on ``(R, E, B)``.

    Attributes:
        counts: ``[R, E]`` records source rank ``s`` routes to expert ``e``.
        alloc: ``[E, R]`` records of expert ``e`` executed on rank ``r``.
        target: ``[R]`` records each rank executes (``sum(alloc, 0)``).
        home: ``[E]`` home rank of each expert.
        flow: ``[R-1, 3]`` the group flows ``(donor, receiver, records)`` in the order
            the planner decided them (``(-1, -1, 0)`` padding); each receiver has one.
        slot_expert: ``[R, B]`` global expert held by each prefetch slot, ``-1`` if empty.
        slot_new: ``[R, B]`` 1 where the slot must be (re)filled this step, else 0
            (0 for empty slots and for residents kept from ``previous``).
        row_expert: ``[R, W]`` expert of each row (see module docstring), ``-1`` if empty.
        row_count: ``[R, W]`` records of each row (0 for empty rows).
        row_offset: ``[R, W+1]`` ``align``-padded row offsets (cu_seqlens).
        num_slots: ``B``.
        align: row padding multiple.
        backend: name of the backend that built it.
        requested: the ``policy=`` the plan was asked for (``"custom"`` from
            ``Plan.from_alloc``); read :attr:`policy` for how it was made.
        planned: planner calls that built this plan (what ``plan_time.plan_time``
            charges: 1 for ``exact``, a named candidate and ``auto``, 0 for static EP and
            ``from_alloc``; ``auto``'s early exit is charged ``StepCost.exit_s``).
        declared_bound: the bound on every rank's load this plan declares
            (``None``: ``max(target)``); read it as :attr:`load_bound`.
        choice: how ``policy="auto"`` chose (:class:`Choice`), ``None`` for the others.
    """

    counts: torch.Tensor
    alloc: torch.Tensor
    target: torch.Tensor
    home: torch.Tensor
    flow: torch.Tensor
    slot_expert: torch.Tensor
    slot_new: torch.Tensor
    row_expert: torch.Tensor
    row_count: torch.Tensor
    row_offset: torch.Tensor
    num_slots: int
    align: int
    backend: str = field(default="reference")
    requested: str = "exact"
    planned: int = 1
    declared_bound: int | None = None
    choice: Choice | None = None

    # ---- sizes -------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        """``R``."""
        return int(self.counts.shape[0])

    @property
    def num_experts(self) -> int:
        """``E``."""
        return int(self.counts.shape[1])

    @property
    def max_local(self) -> int:
        """``M = ceil(E/R)``: home rows per rank and the bound on remote experts."""
        return max_local(self.num_experts, self.num_ranks)

    @property
    def num_rows(self) -> int:
        """``W = M + max(B, M)``: rows per rank."""
        return int(self.row_expert.shape[1])

    @property
    def device(self) -> torch.device:
        return self.alloc.device

    @property
    def policy(self) -> str:
        """How the allocation was made: ``"exact"`` (exact balance, the default),
        ``"static"`` (no replicas), ``"resident"`` (only replicas resident in
        ``previous``'s slots), ``"level-<k>"``, ``"greedy"``, ``"bounded-<eps>"``,
        ``"custom"`` (``Plan.from_alloc``), ``"placed"`` or ``"split"`` (a lookup of the
        slots, ``moonplan.plan.residency.serving.lookup_plan``); for ``policy="auto"`` the
        candidate it chose (a host read of :attr:`choice`)."""
        return self.choice.name() if self.choice is not None else self.requested

    @property
    def predicted(self) -> Predicted:
        """``candidate -> predicted step seconds`` of the candidates ``policy="auto"``
        scored (empty for other policies; a host read)."""
        return self.choice.predicted() if self.choice is not None else Predicted()

    @property
    def load_bound(self) -> int:
        """Declared bound on every rank's load: ``max(target)`` unless declared (host read)."""
        if self.declared_bound is not None:
            return self.declared_bound
        return int(self.target.max()) if self.target.numel() else 0

    # ---- derived tensors (no host sync) -------------------------------------
    def replica_mask(self) -> torch.Tensor:
        """``[E, R]`` bool: ``(e, r)`` is a replica (``alloc > 0`` and ``r`` is not home)."""
        ranks_R = torch.arange(self.num_ranks, device=self.device)
        return (self.alloc > 0) & (self.home[:, None] != ranks_R[None, :])

    def remote_experts(self) -> torch.Tensor:
        """``[R]`` number of remote experts each rank executes (slots + direct)."""
        return self.replica_mask().sum(0)

    def direct_expert(self) -> torch.Tensor:
        """``[R, W-M-B]`` replicas read in place from the home rank (``-1`` if none)."""
        return self.row_expert[:, self.max_local + self.num_slots :]

    def static_load(self) -> torch.Tensor:
        """``[R]`` records each rank would execute under static EP (all on the home rank;
        a plan's ``home`` is always the linear home map, so nothing is read on the host)."""
        return static_load(self.counts)

    def recv_size(self) -> torch.Tensor:
        """``[R]`` rows of each rank's expert-grouped receive buffer (padding included)."""
        return self.row_offset[:, -1]

    # ---- host-side summaries -------------------------------------------------
    def copies(self) -> int:
        """Replica pairs ``(e, r)`` (slots and direct): ``e``'s weights are needed on ``r``."""
        return int(self.replica_mask().sum())

    def new_copies(self) -> int:
        """Slots filled this step (weights actually moved; residents and direct reads excluded)."""
        return int(self.slot_new.sum())

    def summary(self) -> PlanSummary:
        """Host-side figures (synchronises on CUDA): loads before/after, copies, bounds.

        A dict (``plan.summary()["copies"]``) that prints as small tables (``print``)."""
        return PlanSummary(self._figures())

    def _figures(self) -> dict[str, Any]:
        static_R = self.static_load().tolist()
        planned_R = self.alloc.sum(0).tolist()
        n = sum(planned_R)
        mean = n / self.num_ranks
        remote_R = self.remote_experts().tolist()
        return {
            "ranks": self.num_ranks,
            "experts": self.num_experts,
            "slots": self.num_slots,
            "records": n,
            "static_load": static_R,
            "planned_load": planned_R,
            "remote_experts": remote_R,
            "static_max_over_mean": (max(static_R) / mean) if n else 1.0,
            "planned_max_over_mean": (max(planned_R) / mean) if n else 1.0,
            "copies": self.copies(),
            "new_copies": self.new_copies(),
            "direct": int((self.direct_expert() >= 0).sum()),
            "max_remote_experts": max(remote_R),
            "remote_bound": self.max_local,
            "policy": self.policy,
            "load_bound": self.load_bound,
            "predicted": dict(self.predicted),
            "planned": self.planned,
        }

    # ---- construction from any allocation -------------------------------------
    @classmethod
    def from_alloc(
        cls,
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
        counts_RE, N = checked_counts(counts)
        R, E = counts_RE.shape
        B = check_options(slots, align, max_local(E, R), counts_RE, total=N)
        alloc_ER = as_alloc(alloc, counts_RE)
        prev_RB = previous_slots(previous, R, E, B, counts_RE.device)
        check_remote(alloc_ER, max(B, max_local(E, R)))
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
            requested=policy,
            planned=0,
            declared_bound=top if load_bound is None else load_bound,
        )


TENSOR_FIELDS = PLAN_TENSORS
"""The :class:`Plan` fields that are tensors (the rest are scalars and records): the
same names as :data:`PLAN_TENSORS`."""


def plan_to(p: Plan, device: torch.device) -> Plan:
    """``p`` with every tensor field on ``device`` (the same plan; ``p`` if already there).

    One copy per field; on CUDA from host memory the copies are queued on the current
    stream (the plan's consumers run on it)."""
    if p.counts.device == device:
        return p
    moved: dict[str, Any] = {name: getattr(p, name).to(device) for name in TENSOR_FIELDS}
    if p.choice is not None:
        moved["choice"] = p.choice.to(device)
    return dataclasses.replace(p, **moved)


def make_plan(fields: PlanFields, **meta: Any) -> Plan:
    """``Plan(**fields, **meta)``: a backend's layout tensors plus the scalar fields
    (``counts=`` and the rest; ``policy=`` is the :attr:`Plan.requested` name)."""
    args: dict[str, Any] = {**fields._asdict(), **meta}
    if "policy" in args:
        args["requested"] = args.pop("policy")
    return Plan(**args)


def previous_slots(
    previous: Plan | None, R: int, E: int, B: int, device: torch.device
) -> torch.Tensor | None:
    """``previous``'s slots ``[R, B]`` on ``device`` after a shape check, or ``None``."""
    if previous is None:
        return None
    if not isinstance(previous, Plan):
        raise PlanError(f"previous must be a moonplan Plan, got {type(previous).__name__}")
    check_previous((previous.num_ranks, previous.num_experts, previous.num_slots), (R, E, B))
    return previous.slot_expert.to(device)


class PlanSummary(dict[str, Any]):
    """:meth:`Plan.summary`'s figures: a plain dict that prints as tables with units
    (per-rank loads in records, then the plan's totals and bounds)."""

    def __str__(self) -> str:
        from moonplan.tables import render

        head = (
            f"R={self['ranks']} E={self['experts']} slots B={self['slots']} "
            f"records N={self['records']} policy {self['policy']}"
        )
        cols = (self["static_load"], self["planned_load"], self["remote_experts"])
        per_rank = [[str(r), *(str(c[r]) for c in cols)] for r in range(self["ranks"])]
        header = ["rank", "static load (records)", "planned load (records)", "remote experts"]
        totals = [
            ["load max/mean", f"static EP {self['static_max_over_mean']:.3f} -> "
             f"planned {self['planned_max_over_mean']:.3f}"],
            ["replica copies", f"{self['copies']} ({self['new_copies']} new, "
             f"{self['direct']} read directly)"],
            ["remote experts per rank", f"max {self['max_remote_experts']} "
             f"(bound ceil(E/R) = {self['remote_bound']})"],
            ["load bound", f"{self['load_bound']} records"],
        ]  # fmt: skip
        if self.get("predicted"):
            best = sorted(self["predicted"].items(), key=lambda kv: kv[1])
            totals.append(["predicted step", ", ".join(f"{n} {1e3 * t:.3f} ms" for n, t in best)])
        return "\n".join([head, render(header, per_rank), render(["plan", "value"], totals)])
