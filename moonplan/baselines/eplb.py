"""EPLB-style periodic replication: redundant experts chosen from a moving average of loads.

Legend:
    R ranks (GPUs)    E logical experts    P physical expert slots per rank
    X = R * P physical experts (E plus the redundant ones)
    load_E   float64 estimated load of each logical expert
    place_RP int64 logical expert held by each physical slot of each rank

Written from DeepSeek's *description* of its Expert Parallelism Load Balancer
(the EPLB README and DeepSeek-V3 report §3.4; no code was consulted):

* **Replicate**: the ``X - E`` redundant slots go, one at a time, to the expert
  whose load per replica is currently the largest.
* **Pack**: the replicas, each weighing its expert's load divided by its
  replica count, are packed onto GPUs heaviest first, each onto the GPU with
  the least load that still has a free slot, so every GPU gets ``P`` of them.
* **Hierarchical** (when the node count divides the number of expert groups):
  expert groups are first packed onto nodes the same way, then each node
  replicates its own experts and packs the replicas onto its GPUs, keeping a
  group's traffic inside one node. Otherwise the **global** policy replicates
  and packs over all GPUs at once.

The loads come from a moving average of past steps (the README leaves the
estimator to the user and suggests exactly this): every ``period`` steps the
placement is recomputed from the mean counts of the last ``window`` steps. At
run time a logical expert's records are split evenly over its replicas. Ties go
to the lowest id.

**The schedule** (:class:`EPLBPolicy`). A rearrangement at step ``r`` (every ``period``
steps from ``first``) plans from the steps ``[r - window, r)``. Its weight moves
(:func:`placement_moves`) are copied beside the steps ``r .. r + spread - 1``, an equal share
beside each (``PolicyStep.background_C2`` and ``background_share``; the simulator charges
each share's link time, hidden only where the links are idle:
``moonplan.simulate.model_time``), and the new placement serves from step ``r + spread``,
once its weights have arrived. Two models are registered:

* ``eplb``, as deployed: ``window`` 1000, ``period`` 3000 (vLLM's ``EPLBConfig`` defaults,
  ``window_size`` and ``step_interval``; SGLang rebalances every 1000 iterations), the
  moves spread over the whole period (``spread = period``: the gentlest background rate
  that finishes before the next rearrangement; vLLM moves them asynchronously);
* ``eplb-fast`` (``moonplan.baselines.eplb_fast``): ``window = period = 4``, every
  rearrangement's moves beside the one step after it (``spread`` 1), as moonplan's
  fetches are copied.

Redundant experts: ``redundant``, or ``slots`` per rank (``R * slots``: the memory the
simulator gives moonplan's slots), else one per GPU (:func:`default_redundant`).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from moonplan.baselines.policy_base import Policy, PolicyStep, make_step, no_moves
from moonplan.baselines.prehistory import Prehistory
from moonplan.baselines.registry import PolicyInfo, register


def replicate(load_E: Sequence[float], num_physical: int) -> list[int]:
    """Replica count of each expert: ``num_physical - E`` extra replicas, each to the expert
    with the largest load per replica. Returns ``[E]`` ints >= 1 summing to ``num_physical``."""
    E = len(load_E)
    if num_physical < E:
        raise ValueError(f"need at least one physical slot per expert: {num_physical} < {E}")
    count_E = [1] * E
    heap = [(-float(w), e) for e, w in enumerate(load_E)]
    heapq.heapify(heap)
    for _ in range(num_physical - E):
        _, e = heapq.heappop(heap)
        count_E[e] += 1
        heapq.heappush(heap, (-float(load_E[e]) / count_E[e], e))
    return count_E


def balanced_packing(weights: Sequence[float], num_packs: int) -> list[int]:
    """Pack of each item: heaviest first, each onto the least-loaded pack that still has
    room; every pack gets exactly ``len(weights) / num_packs`` items."""
    n = len(weights)
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{n} items do not split evenly into {num_packs} packs")
    room = n // num_packs
    order = sorted(range(n), key=lambda i: (-float(weights[i]), i))
    heap = [(0.0, p) for p in range(num_packs)]
    size = [0] * num_packs
    pack_of = [0] * n
    for i in order:
        load, p = heapq.heappop(heap)
        pack_of[i] = p
        size[p] += 1
        if size[p] < room:
            heapq.heappush(heap, (load + float(weights[i]), p))
    return pack_of


def eplb_placement(
    load_E: Sequence[float], num_ranks: int, num_physical: int, *, nodes: int = 1, groups: int = 1
) -> torch.Tensor:
    """``place_RP``: the logical expert of every physical slot (int64 ``[R, X/R]``).

    Hierarchical when ``nodes > 1`` divides ``groups`` and the sizes split evenly
    (``E`` by ``groups``, ``R`` and ``num_physical`` by ``nodes``); global otherwise.
    Slots of a rank are listed in ascending expert id.
    """
    E, R = len(load_E), num_ranks
    if num_physical % R:
        raise ValueError(f"{num_physical} physical experts do not split over {R} ranks")
    if not _hierarchical_ok(E, R, num_physical, nodes, groups):
        nodes, groups = 1, 1
    group_of_node = _pack_groups(load_E, groups, nodes)
    per_node = R // nodes
    place: list[list[int]] = []
    for n in range(nodes):
        experts = [e for g in group_of_node[n] for e in _group_experts(g, E, groups)]
        place += _place_node(experts, load_E, num_physical // nodes, per_node)
    return torch.tensor(place, dtype=torch.int64).reshape(R, num_physical // R)


def _hierarchical_ok(E: int, R: int, X: int, nodes: int, groups: int) -> bool:
    if nodes <= 1 or groups % nodes or E % groups or R % nodes or X % nodes:
        return False
    return X // nodes >= E // nodes


def _group_experts(g: int, E: int, groups: int) -> range:
    size = E // groups
    return range(g * size, (g + 1) * size)


def _pack_groups(load_E: Sequence[float], groups: int, nodes: int) -> list[list[int]]:
    """Groups held by each node (balanced packing of group loads)."""
    size = len(load_E) // groups
    group_load = [sum(load_E[g * size : (g + 1) * size]) for g in range(groups)]
    node_of = balanced_packing(group_load, nodes)
    return [[g for g in range(groups) if node_of[g] == n] for n in range(nodes)]


def _place_node(
    experts: list[int], load_E: Sequence[float], num_physical: int, num_gpus: int
) -> list[list[int]]:
    """Replicate a node's experts to ``num_physical`` replicas and pack them onto its GPUs."""
    loads = [float(load_E[e]) for e in experts]
    count = replicate(loads, num_physical)
    items = [(e, w / c) for e, w, c in zip(experts, loads, count, strict=True) for _ in range(c)]
    gpu_of = balanced_packing([w for _, w in items], num_gpus)
    return [
        sorted(e for (e, _), g in zip(items, gpu_of, strict=True) if g == gpu)
        for gpu in range(num_gpus)
    ]


def replica_alloc(total_E: torch.Tensor, place_RP: torch.Tensor) -> torch.Tensor:
    """``alloc [E, R]``: each expert's records split evenly over its replicas (rank-major
    order; the first ``T mod n`` replicas take one more). An expert without replicas
    must have no records."""
    R, P = place_RP.shape
    E = total_E.numel()
    e_X = place_RP.reshape(-1)
    n_E = torch.bincount(e_X, minlength=E)
    if bool(((n_E == 0) & (total_E > 0)).any()):
        raise ValueError("an expert with records has no replica in the placement")
    order = torch.argsort(e_X, stable=True)
    first_E = torch.cumsum(n_E, 0) - n_E
    idx_X = torch.empty_like(e_X)
    idx_X[order] = torch.arange(e_X.numel()) - first_E[e_X[order]]
    q_E, m_E = total_E // n_E.clamp(min=1), total_E % n_E.clamp(min=1)
    share_X = q_E[e_X] + (idx_X < m_E[e_X]).to(torch.int64)
    r_X = torch.arange(R).repeat_interleave(P)
    alloc_ER = torch.zeros(E, R, dtype=torch.int64)
    return alloc_ER.index_put_((e_X, r_X), share_X, accumulate=True)


def replica_sync(place_RP: torch.Tensor, num_experts: int) -> dict[str, torch.Tensor]:
    """A training step's replica refresh (``make_step`` fields): the home weights change at
    every optimizer step, so each expert's other replicas are copied again from its first
    holder (lowest rank) before their rows run, as moonplan's slots are refetched
    (``moves_C2``, ``fetch_ER`` and ``src_E``)."""
    R = place_RP.shape[0]
    src_E = torch.full((num_experts,), -1, dtype=torch.int64)
    fetch_ER = torch.zeros(num_experts, R, dtype=torch.bool)
    moves = []
    for r, row in enumerate(place_RP.tolist()):
        for e in sorted(set(row)):
            if src_E[e] < 0:
                src_E[e] = r
            elif not fetch_ER[e, r]:
                fetch_ER[e, r] = True
                moves.append((int(src_E[e]), r))
    moves_C2 = torch.tensor(moves, dtype=torch.int64).reshape(-1, 2) if moves else no_moves()
    return {"moves_C2": moves_C2, "fetch_ER": fetch_ER, "src_E": src_E.clamp(min=0)}


def placement_moves(
    old_RP: torch.Tensor, new_RP: torch.Tensor, ranks_per_node: int = 1
) -> torch.Tensor:
    """``[C, 2]`` copies a rearrangement needs: each (rank, expert) the rank did not hold,
    fetched from an old holder in its own node if there is one, else the lowest old holder."""
    holders: dict[int, list[int]] = {}
    for r, row in enumerate(old_RP.tolist()):
        for e in row:
            holders.setdefault(e, []).append(r)
    moves = []
    for r, row in enumerate(new_RP.tolist()):
        held = set(old_RP[r].tolist())
        for e in sorted(set(row) - held):
            near = [h for h in holders[e] if h // ranks_per_node == r // ranks_per_node]
            moves.append(((near or holders[e])[0], r))
    return torch.tensor(moves, dtype=torch.int64).reshape(-1, 2) if moves else no_moves()


def default_redundant(num_experts: int, num_ranks: int) -> int:
    """The smallest redundant count ``>= R`` (one per GPU, as DeepSeek-V3's prefill uses) that
    makes ``E + redundant`` divisible by ``R``."""
    return num_ranks + (-(num_experts + num_ranks)) % num_ranks


DEPLOYED_WINDOW = 1000
"""vLLM ``EPLBConfig.window_size`` default: steps of load history averaged."""
DEPLOYED_PERIOD = 3000
"""vLLM ``EPLBConfig.step_interval`` default: steps between rearrangements."""


@dataclass(frozen=True)
class EPLBSettings:
    """EPLB's knobs (the options :func:`~moonplan.baselines.registry.make_policy` passes it).

    Attributes:
        redundant: extra physical experts (``E + redundant`` must be divisible by ``R``).
        slots: redundant experts per rank instead (``redundant = R * slots``); ``None`` with
            ``redundant`` ``None``: :func:`default_redundant`.
        period: steps between rearrangements (>= 1).
        window: steps of history averaged for the load estimate (>= 1).
        first: a step of the schedule: rearrangements at ``first + n * period`` for every
            integer ``n`` (``None``: ``window``, the first once the window is full).
        spread: steps the moves of a rearrangement are spread over, in ``[1, period]``
            (``None``: ``period``); the new placement serves after them.
        nodes: nodes of the EP group (hierarchical policy when it divides ``groups``).
        groups: expert groups (DeepSeek-V3: 8); 1 for models without group-limited routing.
    """

    redundant: int | None = None
    slots: int | None = None
    period: int = DEPLOYED_PERIOD
    window: int = DEPLOYED_WINDOW
    first: int | None = None
    spread: int | None = None
    nodes: int = 1
    groups: int = 1

    def __post_init__(self) -> None:
        if min(self.period, self.window, self.nodes, self.groups) < 1:
            raise ValueError("period, window, nodes and groups must be >= 1")
        if not 1 <= self.moves_spread <= self.period:
            raise ValueError(f"spread must be in [1, period = {self.period}], got {self.spread}")
        if self.slots is not None and self.slots < 0:
            raise ValueError(f"slots must be >= 0, got {self.slots}")

    @property
    def moves_spread(self) -> int:
        return self.period if self.spread is None else int(self.spread)

    def redundant_for(self, num_experts: int, num_ranks: int) -> int:
        """The redundant experts these settings give ``E`` experts on ``R`` ranks."""
        if self.slots is not None:
            by_slots = num_ranks * int(self.slots)
            if self.redundant is not None and self.redundant != by_slots:
                raise ValueError(f"redundant = {self.redundant} and slots = {self.slots} "
                                 f"disagree (R * slots = {by_slots})")  # fmt: skip
            return by_slots
        if self.redundant is None:
            return default_redundant(num_experts, num_ranks)
        return int(self.redundant)


@dataclass(frozen=True)
class Rearrangement:
    """A placement whose weights are being copied (module docstring, "The schedule").

    Attributes:
        place_RP: the new placement.
        moves_C2: the copies it needs from the placement it replaces.
        ready: the step from which it serves.
    """

    place_RP: torch.Tensor
    moves_C2: torch.Tensor
    ready: int


class EPLBPolicy(Policy):
    """Periodic EPLB-style replication on the schedule of the module docstring, for ``R``
    ranks and ``E`` experts; ``settings`` are the fields of :class:`EPLBSettings`.

    Before any rearrangement the placement is planned from uniform loads. Steps are
    numbered from 0 at the first :meth:`step` after :meth:`reset`; :meth:`prime` replays
    steps before it (negative numbers) from a :class:`Prehistory`.
    """

    name = "eplb"

    def __init__(
        self, num_ranks: int, num_experts: int, *, stale_slots: bool = False, **settings: Any
    ) -> None:
        super().__init__(num_ranks, num_experts)
        self.stale_slots = bool(stale_slots)  # training: replicas synced every step
        R, E, s = num_ranks, num_experts, EPLBSettings(**settings)
        self.redundant = s.redundant_for(E, R)
        if self.redundant < 0 or (E + self.redundant) % R or E + self.redundant < R:
            raise ValueError(
                f"EPLB needs E + redundant = {E} + {self.redundant} to be a positive "
                f"multiple of R = {R}"
            )
        self.period, self.window, self.spread = int(s.period), int(s.window), s.moves_spread
        self.first = self.window if s.first is None else int(s.first)
        self.nodes, self.groups = int(s.nodes), int(s.groups)
        self.reset()

    def reset(self) -> None:
        self.t = 0
        self.history: deque[tuple[int, torch.Tensor]] = deque(maxlen=self.window)
        self.place_RP = self._plan([1.0] * self.num_experts)
        self.pending: Rearrangement | None = None

    def _plan(self, load_E: Sequence[float]) -> torch.Tensor:
        return eplb_placement(
            load_E,
            self.num_ranks,
            self.num_experts + self.redundant,
            nodes=self.nodes,
            groups=self.groups,
        )

    def rearranges_at(self, t: int) -> bool:
        """Whether step ``t`` is a rearrangement of the schedule."""
        return (t - self.first) % self.period == 0

    def _advance(self) -> None:
        """At step ``self.t``: serve a placement whose weights have arrived, then rearrange
        if the schedule says so and history of the window exists."""
        t = self.t
        if self.pending is not None and self.pending.ready <= t:
            self.place_RP, self.pending = self.pending.place_RP, None
        if not self.rearranges_at(t):
            return
        seen = [total for step, total in self.history if step >= t - self.window]
        if not seen:
            return
        load_E = torch.stack(seen).to(torch.float64).mean(0)
        new_RP = self._plan(load_E.tolist())
        moves = placement_moves(self.place_RP, new_RP, self._ranks_per_node())
        self.pending = Rearrangement(new_RP, moves, t + self.spread)

    def _moves_now(self) -> torch.Tensor:
        """The copies beside step ``self.t`` (those of a rearrangement still in flight)."""
        if self.pending is None or self.pending.ready <= self.t:
            return no_moves()
        return self.pending.moves_C2

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        self._advance()
        total_E = counts_RE.sum(0)
        alloc_ER = replica_alloc(total_E, self.place_RP)
        moves = self._moves_now()
        self.history.append((self.t, total_E))
        self.t += 1
        sync = replica_sync(self.place_RP, self.num_experts) if self.stale_slots else {}
        return make_step(
            self.name, counts_RE, alloc_ER, copies=self.redundant, background_C2=moves,
            background_share=1.0 / self.spread, **sync,
        )  # fmt: skip

    def steps_before(self) -> list[tuple[int, int]]:
        """Step ranges before step 0 whose totals the schedule reads: the windows of the
        rearrangements from the last one whose placement serves at step 0 up to the first
        that plans from the trace's steps alone (``r >= window``)."""
        r = self.first + ((-1 - self.first) // self.period) * self.period  # last r < 0
        if r + self.spread > 0:  # still in flight at step 0: the one before serves
            r -= self.period
        out = []
        while r < self.window:
            out.append((r - self.window, min(r, 0)))
            r += self.period
        return [(a, b) for a, b in out if a < b]

    def prime(self, before: Prehistory) -> None:
        """Replay the steps ``before.first .. -1``: their totals go to the history, their
        rearrangements are made (the steps ``before`` lacks are steps it did not see)."""
        if self.t != 0 or self.history:
            raise ValueError("prime an EPLB policy right after reset, before its first step")
        totals = before.by_step()
        for t in range(before.first, 0):
            self.t = t
            self._advance()
            if t in totals:
                self.history.append((t, totals[t].to(torch.int64)))
        self.t = 0

    def _ranks_per_node(self) -> int:
        return max(1, self.num_ranks // self.nodes)


SCHEDULE_OPTIONS = {"eplb_window": "window", "eplb_period": "period", "eplb_first": "first",
                    "eplb_spread": "spread"}  # fmt: skip
"""Options of ``make_policy("eplb", ...)`` for its schedule -> :class:`EPLBSettings` fields
(prefixed: ``period`` and ``window`` are ``eplb-fast``'s, and one option set serves
every policy)."""


def _build(name: str, num_ranks: int, num_experts: int, **options: Any) -> EPLBPolicy:
    settings = {SCHEDULE_OPTIONS.get(k, k): v for k, v in options.items() if v is not None}
    return EPLBPolicy(num_ranks, num_experts, **settings)


_OTHER = tuple(f.name for f in fields(EPLBSettings) if f.name not in SCHEDULE_OPTIONS.values())
register(PolicyInfo("eplb", _build, order=40,
                    options=(*_OTHER, *SCHEDULE_OPTIONS, "stale_slots")))  # fmt: skip
