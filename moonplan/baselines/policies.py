"""A common interface for balancing policies, so that all run on the same counts.

Legend:
    R ranks    E experts    C weight copies moved in one step
    counts_RE  int64 records source rank ``s`` routes to expert ``e`` (one step, all-gathered)
    alloc_ER   int64 records of expert ``e`` that rank ``r`` executes (real records only)
    rows_ER    int64 rows rank ``r`` computes for expert ``e`` (``alloc_ER`` plus padding)
    sent_RE    int64 rows source ``s`` sends towards expert ``e`` (counts minus drops, plus padding)
    moves_C2   int64 ``(source rank, destination rank)`` of each expert-weight copy moved

A policy is an object with ``step(counts_RE) -> PolicyStep``; it may keep state
between steps (EPLB's history, moonplan's resident slots). ``reset()`` forgets it.
Policies here: static EP with linear or round-robin placement, the MoonEP greedy,
moonplan without and with resident slots (``previous=``), and moonplan's cost-aware
choice (``policy="auto"``, which needs the simulator's ``StepCost``). EPLB-style periodic
replication and Switch-style capacity live in ``eplb.py`` and ``capacity.py``;
:func:`make_policy` builds any of them by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import moonplan
from moonplan.baselines.moonep_greedy import moonep_greedy_alloc
from moonplan.baselines.round_robin import placement_alloc, round_robin_home
from moonplan.plan.home import home_map
from moonplan.plan.validate import as_counts
from moonplan.stepcost import StepCost, plan_fetch_ER

if TYPE_CHECKING:
    pass


@dataclass(frozen=True, eq=False)
class PolicyStep:
    """What one policy does with one step's counts (CPU int64 tensors, records or rows).

    Attributes:
        name: the policy's name.
        alloc_ER: ``[E, R]`` real records of expert ``e`` executed on rank ``r``.
        rows_ER: ``[E, R]`` rows computed (``alloc_ER`` plus any static-shape padding).
        sent_RE: ``[R, E]`` rows source ``s`` sends towards expert ``e`` (after drops,
            with padding); ``sent_RE.sum(0) == rows_ER.sum(1)``.
        dropped: records not executed at all (capacity overflow); moonplan drops none.
        copies: expert weight instances executed off their primary holder this step
            (replica pairs for home-based policies; redundant experts held for EPLB).
        moves_C2: ``[C, 2]`` weight copies that must arrive before this step's experts
            run (source rank, destination rank): moonplan's and the greedy's prefetch.
        background_C2: ``[C', 2]`` weight copies moved off the critical path
            (EPLB's periodic rearrangement).
        fetch_ER: bool ``[E, R]`` pairs whose weights must arrive before their rows run
            this step (the expert of each ``moves_C2`` copy); ``None``: none.
        src_E: ``[E]`` rank each expert's weights are fetched from; ``None``: no fetch.
        planned: planner runs on the critical path this step.
        choice: the candidate a choosing policy took this step (``moonplan-auto``:
            ``plan.policy``, e.g. ``"static"``); ``""`` for the others.
    """

    name: str
    alloc_ER: torch.Tensor
    rows_ER: torch.Tensor
    sent_RE: torch.Tensor
    dropped: int
    copies: int
    moves_C2: torch.Tensor
    background_C2: torch.Tensor
    fetch_ER: torch.Tensor | None = None
    src_E: torch.Tensor | None = None
    planned: int = 1
    choice: str = ""

    @property
    def load_R(self) -> torch.Tensor:
        """``[R]`` real records each rank executes."""
        return self.alloc_ER.sum(0)

    @property
    def new_copies(self) -> int:
        """Expert weights moved this step (blocking and background)."""
        return int(self.moves_C2.shape[0] + self.background_C2.shape[0])

    def moved_bytes(self, expert_bytes: float) -> float:
        """Bytes of expert weights moved this step, given one expert's bytes (``3*H*F*s``)."""
        return self.new_copies * float(expert_bytes)


def no_moves() -> torch.Tensor:
    """An empty ``[0, 2]`` moves tensor."""
    return torch.zeros(0, 2, dtype=torch.int64)


def make_step(
    name: str,
    counts_RE: torch.Tensor,
    alloc_ER: torch.Tensor,
    *,
    copies: int = 0,
    moves_C2: torch.Tensor | None = None,
    background_C2: torch.Tensor | None = None,
    fetch_ER: torch.Tensor | None = None,
    src_E: torch.Tensor | None = None,
    planned: int = 1,
    choice: str = "",
) -> PolicyStep:
    """A dropless, unpadded :class:`PolicyStep` (rows = alloc, sent = counts)."""
    return PolicyStep(
        name=name,
        alloc_ER=alloc_ER,
        rows_ER=alloc_ER,
        sent_RE=counts_RE,
        dropped=0,
        copies=copies,
        moves_C2=no_moves() if moves_C2 is None else moves_C2,
        background_C2=no_moves() if background_C2 is None else background_C2,
        fetch_ER=fetch_ER,
        src_E=src_E,
        planned=planned,
        choice=choice,
    )


class Policy:
    """Base class: a named policy for ``R`` ranks and ``E`` experts (see module docstring)."""

    name = "policy"

    def __init__(self, num_ranks: int, num_experts: int) -> None:
        if num_ranks < 1 or num_experts < 1:
            raise ValueError(f"need ranks >= 1 and experts >= 1, got {num_ranks}, {num_experts}")
        self.num_ranks = int(num_ranks)
        self.num_experts = int(num_experts)

    def reset(self) -> None:
        """Forget any state kept between steps (stateless policies: nothing)."""

    def step(self, counts: Any) -> PolicyStep:
        """Allocate one step's counts ``[R, E]``; returns a :class:`PolicyStep`."""
        raise NotImplementedError

    def _counts(self, counts: Any) -> torch.Tensor:
        return as_counts(counts, self.num_ranks).cpu()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(R={self.num_ranks}, E={self.num_experts})"


class StaticPolicy(Policy):
    """Static EP: every record runs on its expert's only holder; no copies, no drops.

    ``placement="linear"`` (contiguous blocks, the first ``E mod R`` ranks one more:
    vLLM's default) or ``"round-robin"`` (expert ``e`` on rank ``e mod R``).
    """

    def __init__(self, num_ranks: int, num_experts: int, placement: str = "linear") -> None:
        super().__init__(num_ranks, num_experts)
        if placement == "linear":
            self.home_E = home_map(num_experts, num_ranks)
        elif placement == "round-robin":
            self.home_E = round_robin_home(num_experts, num_ranks)
        else:
            raise ValueError(f"unknown placement {placement!r}; use 'linear' or 'round-robin'")
        self.name = f"static-{placement}"

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        return make_step(self.name, counts_RE, placement_alloc(counts_RE, self.home_E))


class GreedyPolicy(Policy):
    """The upstream MoonEP greedy (``moonep_greedy_alloc``): exact balance, every replica
    re-copied from its home rank every step."""

    name = "moonep-greedy"

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        alloc_ER = moonep_greedy_alloc(counts_RE)
        home_E = home_map(self.num_experts, self.num_ranks)
        moves_C2 = replica_moves(alloc_ER, home_E)
        fetch_ER = (alloc_ER > 0) & (home_E[:, None] != torch.arange(self.num_ranks)[None, :])
        return make_step(
            self.name,
            counts_RE,
            alloc_ER,
            copies=moves_C2.shape[0],
            moves_C2=moves_C2,
            fetch_ER=fetch_ER,
            src_E=home_E,
        )


class MoonplanPolicy(Policy):
    """``moonplan.plan`` every step; with ``resident=True`` the last plan is passed as
    ``previous=`` so resident replicas are reused and only new slots move weights."""

    def __init__(
        self, num_ranks: int, num_experts: int, *, resident: bool = False, slots: int | None = None
    ) -> None:
        super().__init__(num_ranks, num_experts)
        self.resident = resident
        self.slots = slots
        self.name = "moonplan-resident" if resident else "moonplan"
        self._previous: moonplan.Plan | None = None

    def reset(self) -> None:
        self._previous = None

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        prev = self._previous if self.resident else None
        p = moonplan.plan(counts_RE, slots=self.slots, previous=prev, backend="torch")
        self._previous = p
        return make_step(
            self.name,
            counts_RE,
            p.alloc,
            copies=p.copies(),
            moves_C2=slot_moves(p),
            fetch_ER=plan_fetch_ER(p),
            src_E=p.home.cpu(),
        )


class MoonplanAutoPolicy(Policy):
    """``moonplan.plan(..., policy="auto", cost=cost)`` every step, the chosen plan kept as
    ``previous=`` (its resident slots are reused by the next step's candidates).

    ``cost`` is the :class:`~moonplan.stepcost.StepCost` the choice minimises; the
    simulator passes the one it charges the step with (same model, hardware, schedule
    and planning time), so the plan's predicted time is its simulated time. Planning is
    charged per planner run (``plan.planned``).
    """

    name = "moonplan-auto"

    def __init__(
        self, num_ranks: int, num_experts: int, *, cost: StepCost, slots: int | None = None
    ) -> None:
        super().__init__(num_ranks, num_experts)
        if not isinstance(cost, StepCost):
            raise ValueError(f"moonplan-auto needs cost=StepCost(...), got {cost!r}")
        self.cost = cost
        self.slots = slots
        self._previous: moonplan.Plan | None = None

    def reset(self) -> None:
        self._previous = None

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        p = moonplan.plan(
            counts_RE,
            slots=self.slots,
            previous=self._previous,
            backend="torch",
            policy="auto",
            # StepCost meets CostModel at runtime; the Protocol declares plan_s as a
            # settable attribute, which a frozen dataclass is not (reported to the planner)
            cost=self.cost,
        )
        self._previous = p
        return make_step(
            self.name,
            counts_RE,
            p.alloc,
            copies=p.copies(),
            moves_C2=slot_moves(p),
            fetch_ER=plan_fetch_ER(p),
            src_E=p.home.cpu(),
            planned=p.planned,
            choice=p.policy,
        )


def replica_moves(alloc_ER: torch.Tensor, home_E: torch.Tensor) -> torch.Tensor:
    """``[C, 2]`` (home rank, rank) of every replica pair of ``alloc_ER`` (rank-major order)."""
    R = alloc_ER.shape[1]
    remote_ER = (alloc_ER > 0) & (home_E[:, None] != torch.arange(R)[None, :])
    r_C, e_C = remote_ER.t().nonzero(as_tuple=True)
    return torch.stack([home_E[e_C], r_C], dim=1)


def slot_moves(p: moonplan.Plan) -> torch.Tensor:
    """``[C, 2]`` (home rank, rank) of every slot a plan fills this step (``slot_new``)."""
    r_C, j_C = (p.slot_new.cpu() > 0).nonzero(as_tuple=True)
    e_C = p.slot_expert.cpu()[r_C, j_C]
    return torch.stack([p.home.cpu()[e_C], r_C], dim=1)


POLICY_NAMES = (
    "static-linear",
    "static-round-robin",
    "capacity-1.0",
    "capacity-1.25",
    "eplb",
    "moonep-greedy",
    "moonplan",
    "moonplan-resident",
    "moonplan-auto",
)
"""Names understood by :func:`make_policy`, in report order."""


def make_policy(name: str, num_ranks: int, num_experts: int, **options: Any) -> Policy:
    """Build a policy by name (see :data:`POLICY_NAMES`).

    ``capacity-<f>`` accepts any factor ``f > 0`` (e.g. ``capacity-2.0``). ``options``
    go to the EPLB policy (``redundant``, ``period``, ``window``, ``nodes``, ``groups``)
    and to moonplan (``slots``; ``moonplan-auto`` also needs ``cost``, a
    :class:`~moonplan.stepcost.StepCost`); options that a policy does not take are ignored.
    """
    from moonplan.baselines.capacity import CapacityPolicy
    from moonplan.baselines.eplb import EPLBPolicy

    R, E = num_ranks, num_experts
    if name == "static-linear":
        return StaticPolicy(R, E, "linear")
    if name == "static-round-robin":
        return StaticPolicy(R, E, "round-robin")
    if name.startswith("capacity-"):
        capacity = CapacityPolicy(R, E, factor=_factor(name))
        capacity.name = name  # as asked: "capacity-2" stays "capacity-2"
        return capacity
    if name == "eplb":
        keys = ("redundant", "period", "window", "nodes", "groups")
        return EPLBPolicy(R, E, **{k: v for k, v in options.items() if k in keys})
    if name == "moonep-greedy":
        return GreedyPolicy(R, E)
    if name in ("moonplan", "moonplan-resident"):
        slots = options.get("slots")
        return MoonplanPolicy(R, E, resident=name.endswith("resident"), slots=slots)
    if name == "moonplan-auto":
        if options.get("cost") is None:
            raise ValueError("moonplan-auto needs cost=StepCost(...) (the model it minimises)")
        return MoonplanAutoPolicy(R, E, cost=options["cost"], slots=options.get("slots"))
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")


def _factor(name: str) -> float:
    try:
        factor = float(name.split("-", 1)[1])
    except ValueError:
        raise ValueError(f"bad capacity policy {name!r}; use e.g. capacity-1.25") from None
    if not factor > 0:
        raise ValueError(f"capacity factor must be > 0, got {factor}")
    return factor
