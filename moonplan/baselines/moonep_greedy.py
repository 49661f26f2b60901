"""The upstream MoonEP planner's greedy, written from its public description.

Legend: R ranks, E experts, C replica copies; ``alloc [E, R]`` as in :class:`moonplan.Plan`;
``home_E`` int64 ``[E]`` home rank of each expert; ``moves_C2`` int64 ``[C, 2]``
(home rank, destination rank) of each copy.

Description followed (the MoonEP README; docs/simulator.md): balance home groups greedily —
the donor with the largest excess fills the most underloaded receiver
completely, and a donor that overshoots becomes a receiver; then, within each
donor group, the destination with the largest remaining quota takes from the
local expert with the most remaining records. Every replica is re-copied every
step (no resident slots). It is a baseline for copy counts, kept independent
of moonplan's planner code on purpose (heaps instead of scans).
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from moonplan.baselines.policy_base import Policy, PolicyStep, make_step
from moonplan.baselines.registry import PolicyInfo, register
from moonplan.plan.home import home_list, home_map, targets_list
from moonplan.plan.placement import static_load
from moonplan.plan.validate import as_counts

MOONEP_PLAN_US = 51.0
"""Planning time per planner run (us) the simulator charges the greedy and moonplan:
MoonEP's published GPU planning time on H20/H200 EP8 (docs/simulator.md)."""


def moonep_greedy_alloc(counts: Any) -> torch.Tensor:
    """The greedy's allocation.

    Args:
        counts: ``[R, E]`` non-negative integer counts.

    Returns:
        alloc_ER: int64 ``[E, R]`` on the CPU.
    """
    counts_RE = as_counts(counts).cpu()
    R, E = counts_RE.shape
    home = home_list(E, R)
    total_E = counts_RE.sum(0).tolist()
    loads = [0] * R
    for e, t in enumerate(total_E):
        loads[home[e]] += t
    targets = targets_list(sum(total_E), R)
    outflows = _balance(loads, targets)
    alloc = [[0] * R for _ in range(E)]
    for donor, dests in outflows.items():
        experts = [e for e in range(E) if home[e] == donor]
        _split(experts, total_E, dests, alloc)
    for e in range(E):
        alloc[e][home[e]] += total_E[e]
    return torch.tensor(alloc, dtype=torch.int64).reshape(E, R)


def _balance(loads: list[int], targets: list[int]) -> dict[int, dict[int, int]]:
    """Group flows ``{donor: {receiver: records}}`` with two heaps."""
    excess = [loads[r] - targets[r] for r in range(len(loads))]
    donors = [(-x, r) for r, x in enumerate(excess) if x > 0]
    receivers = [(x, r) for r, x in enumerate(excess) if x < 0]
    heapq.heapify(donors)
    heapq.heapify(receivers)
    flows: dict[int, dict[int, int]] = {}
    while donors:
        neg_x, d = heapq.heappop(donors)
        deficit, r = heapq.heappop(receivers)
        flows.setdefault(d, {})[r] = -deficit
        left = -neg_x + deficit
        if left > 0:
            heapq.heappush(donors, (-left, d))
        elif left < 0:
            heapq.heappush(receivers, (left, d))
    return flows


def _split(
    experts: list[int], remaining: list[int], dests: dict[int, int], alloc: list[list[int]]
) -> None:
    """One group's quotas out of its experts (largest quota takes from fullest expert)."""
    quota = [(-q, r) for r, q in dests.items()]
    pool = [(-remaining[e], e) for e in experts if remaining[e] > 0]
    heapq.heapify(quota)
    heapq.heapify(pool)
    while quota:
        neg_q, r = heapq.heappop(quota)
        neg_t, e = heapq.heappop(pool)
        take = min(-neg_q, -neg_t)
        alloc[e][r] += take
        remaining[e] -= take
        if -neg_q > take:
            heapq.heappush(quota, (neg_q + take, r))
        if remaining[e] > 0:
            heapq.heappush(pool, (-remaining[e], e))


def replica_pairs(alloc_ER: torch.Tensor, home_E: torch.Tensor | None = None) -> torch.Tensor:
    """bool ``[E, R]`` (CPU): pairs ``(e, r)`` with records of ``e`` on a rank not its home
    (``home_E``: ``home_map(E, R)``, if the caller has it)."""
    E, R = alloc_ER.shape
    home_E = home_map(E, R) if home_E is None else home_E
    return (alloc_ER.cpu() > 0) & (home_E[:, None] != torch.arange(R)[None, :])


def replica_count(alloc_ER: torch.Tensor) -> int:
    """Copies of an allocation: the number of :func:`replica_pairs`."""
    return int(replica_pairs(alloc_ER).sum())


def copies_lower_bound(counts: Any) -> int:
    """Fewest copies any exact plan needs: one per rank whose home load is below its target."""
    counts_RE = as_counts(counts).cpu()
    load_R = static_load(counts_RE)
    target_R = torch.tensor(targets_list(int(counts_RE.sum()), counts_RE.shape[0]))
    return int((load_R < target_R).sum())


def replica_moves(
    alloc_ER: torch.Tensor,
    pairs_ER: torch.Tensor | None = None,
    home_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moves_C2`` of every :func:`replica_pairs` pair of ``alloc_ER`` (rank-major order);
    ``pairs_ER`` and ``home_E``: those pairs and ``home_map(E, R)``, if the caller has them."""
    E, R = alloc_ER.shape
    home_E = home_map(E, R) if home_E is None else home_E
    pairs_ER = replica_pairs(alloc_ER, home_E) if pairs_ER is None else pairs_ER
    r_C, e_C = pairs_ER.t().nonzero(as_tuple=True)
    return torch.stack([home_E[e_C], r_C], dim=1)


class GreedyPolicy(Policy):
    """The upstream MoonEP greedy (:func:`moonep_greedy_alloc`): exact balance, every replica
    re-copied from its home rank every step."""

    name = "moonep-greedy"

    def step(self, counts: Any) -> PolicyStep:
        """The step of :func:`moonep_greedy_alloc` (its home map and replica pairs built once)."""
        counts_RE = self._counts(counts)
        alloc_ER = moonep_greedy_alloc(counts_RE)
        home_E = home_map(self.num_experts, self.num_ranks)
        pairs_ER = replica_pairs(alloc_ER, home_E)
        moves_C2 = replica_moves(alloc_ER, pairs_ER, home_E)
        return make_step(
            self.name,
            counts_RE,
            alloc_ER,
            copies=moves_C2.shape[0],
            moves_C2=moves_C2,
            fetch_ER=pairs_ER,
            src_E=home_E,
        )


register(
    PolicyInfo(
        "moonep-greedy",
        lambda name, R, E: GreedyPolicy(R, E),
        label="greedy",
        style=("--", "s"),  # dashed: it often coincides with moonplan
        plan_us=MOONEP_PLAN_US,
        order=50,
    )
)
