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
run time a logical expert's records are split evenly over its replicas. Weights
moved by a rearrangement are reported as background moves (deployments move
them asynchronously, every few thousand steps). Ties go to the lowest id.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from moonplan.baselines.policy_base import Policy, PolicyStep, make_step, no_moves
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


@dataclass(frozen=True)
class EPLBSettings:
    """EPLB's knobs (the options :func:`~moonplan.baselines.registry.make_policy` passes it).

    Attributes:
        redundant: extra physical experts (``E + redundant`` must be divisible by ``R``;
            ``None``: :func:`default_redundant`).
        period: steps between rearrangements (>= 1).
        window: steps of history averaged for the load estimate (``None``: ``period``).
        nodes: nodes of the EP group (hierarchical policy when it divides ``groups``).
        groups: expert groups (DeepSeek-V3: 8); 1 for models without group-limited routing.
    """

    redundant: int | None = None
    period: int = 8
    window: int | None = None
    nodes: int = 1
    groups: int = 1

    def __post_init__(self) -> None:
        window = self.period if self.window is None else self.window
        if min(self.period, window, self.nodes, self.groups) < 1:
            raise ValueError("period, window, nodes and groups must be >= 1")


class EPLBPolicy(Policy):
    """Periodic EPLB-style replication (see the module docstring) for ``R`` ranks and ``E``
    experts; ``settings`` are the fields of :class:`EPLBSettings`.

    Before any history exists the placement is planned from uniform loads.
    """

    name = "eplb"

    def __init__(self, num_ranks: int, num_experts: int, **settings: Any) -> None:
        super().__init__(num_ranks, num_experts)
        R, E, s = num_ranks, num_experts, EPLBSettings(**settings)
        self.redundant = default_redundant(E, R) if s.redundant is None else int(s.redundant)
        if self.redundant < 0 or (E + self.redundant) % R or E + self.redundant < R:
            raise ValueError(
                f"EPLB needs E + redundant = {E} + {self.redundant} to be a positive "
                f"multiple of R = {R}"
            )
        self.period, self.window = int(s.period), int(s.window or s.period)
        self.nodes, self.groups = int(s.nodes), int(s.groups)
        self.reset()

    def reset(self) -> None:
        self.t = 0
        self.history: deque[torch.Tensor] = deque(maxlen=self.window)
        self.place_RP = self._plan([1.0] * self.num_experts)

    def _plan(self, load_E: Sequence[float]) -> torch.Tensor:
        return eplb_placement(
            load_E,
            self.num_ranks,
            self.num_experts + self.redundant,
            nodes=self.nodes,
            groups=self.groups,
        )

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        background_C2 = no_moves()
        if self.t > 0 and self.t % self.period == 0 and self.history:
            load_E = torch.stack(list(self.history)).to(torch.float64).mean(0)
            new_RP = self._plan(load_E.tolist())
            background_C2 = placement_moves(self.place_RP, new_RP, self._ranks_per_node())
            self.place_RP = new_RP
        total_E = counts_RE.sum(0)
        alloc_ER = replica_alloc(total_E, self.place_RP)
        self.history.append(total_E)
        self.t += 1
        return make_step(
            self.name, counts_RE, alloc_ER, copies=self.redundant, background_C2=background_C2
        )

    def _ranks_per_node(self) -> int:
        return max(1, self.num_ranks // self.nodes)


def _build(name: str, num_ranks: int, num_experts: int, **settings: Any) -> EPLBPolicy:
    return EPLBPolicy(num_ranks, num_experts, **settings)


register(PolicyInfo("eplb", _build, order=40, options=tuple(f.name for f in fields(EPLBSettings))))
