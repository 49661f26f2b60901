"""A balancing candidate's predicted step time from its allocation, without laying it out.

Legend:
    R ranks, E experts, B slots, N records in all
    counts_RE  int64 [R, E] validated router counts (host)
    prev_RB    int64 [R, B] previous plan's slots (``-1`` empty), or None
    prev_F3    int64 [R-1, 3] previous plan's flows, or None
    alloc_ER   int64 [E, R] the candidate's allocation
    fetch_ER   bool [E, R] pairs whose weights the candidate's plan moves this step

``policy="auto"`` scores a candidate with ``cost.plan_time(plan)``, which reads the
built plan's allocation, counts, home map and fetched pairs (``stepcost.step_cost
.plan_fetch_ER``: its new slots and its direct replicas). The fetched pairs follow
from the allocation and the previous slots alone: the slot placement
(``reference.place_slots``, ``torch_layout.place_slots_torch``,
``from_alloc.layout_torch``) keeps a replica that sits in one of its rank's previous
slots in that slot, and puts every other replica in a new slot or, past the free
slots, in a direct row. Both are fetched, so

    fetch_ER = (alloc_ER > 0) & (home_E != r) & ~(e in prev_RB[r])

whatever the slot budget ``B`` or the residents evicted (``tests/plan/test_search.py``
checks it against ``plan_fetch_ER`` of the built plans). So a candidate is scored by
``cost.step_time(alloc, counts, fetch, home)``: the plan's score, without its slots,
rows, offsets and ``Plan``.

The allocation is the group-flow construction's (steps 1-2 of ``moonplan/plan/README.md``):
with the torch builder, the host scans the torch backend runs on CPU tensors
(``group_flows.host_alloc``: its flows and their split) on host integers that
every candidate of one choice shares (:class:`Context`: loads, residents, previous
flows), into a numpy allocation; with the reference builder, the reference planner.

A choice reads its inputs on the host once: ``choose.decide`` builds the screens'
``screen.Step`` and derives the :class:`Context` from it (:meth:`Context.of_step`);
:meth:`Context.of`, which reads the counts and ``previous`` on its own, is its reference
(``tests/plan/test_search.py`` pins them equal, field by field and in order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moonplan.plan.group_flows import host_alloc, warm_maps
from moonplan.plan.home import home_edges, home_list, targets_list
from moonplan.plan.reference import Flow, previous_flows, reference_fields
from moonplan.plan.screen import Step


@dataclass(frozen=True)
class Context:
    """What every construction and score of one choice shares (host values, read-only).

    Attributes:
        counts_RE: int64 numpy ``[R, E]`` the counts.
        home_E: int64 numpy ``[E]`` the home map.
        total_E: records per expert (ints ``[E]``); load: static loads (ints ``[R]``).
        warm, warm_experts: ``previous``'s residents as ``group_flows.warm_maps`` gives them.
        previous: ``previous``'s flows in decision order (``reference.previous_flows``).
        moved_ER: bool numpy ``[E, R]``, ``r`` neither ``e``'s home nor holding it in a
            previous slot: a plan executing ``e`` on ``r`` fetches it (module docstring).
        prev: ``(prev_RB, prev_F3)`` as given (the reference builder reads them).
    """

    counts_RE: np.ndarray
    home_E: np.ndarray
    total_E: list[int]
    load: list[int]
    warm: dict[int, set[int]] | None
    warm_experts: dict[int, dict[int, list[int]]]
    previous: list[Flow]
    moved_ER: np.ndarray
    prev: tuple[torch.Tensor | None, torch.Tensor | None]

    @classmethod
    def of(
        cls, counts_RE: torch.Tensor, prev_RB: torch.Tensor | None, prev_F3: torch.Tensor | None
    ) -> Context:
        """The context of ``counts_RE`` (any device: one host copy) and ``previous``,
        derived on its own: the reference of :meth:`of_step`."""
        c_RE = counts_RE.detach().cpu().numpy().astype(np.int64, copy=False)
        R, E = c_RE.shape
        home = home_list(E, R)
        home_E = np.asarray(home, dtype=np.int64)
        total_E = c_RE.sum(0)
        load = np.bincount(home_E, weights=total_E, minlength=R).astype(np.int64).tolist()
        p_RB = None if prev_RB is None else prev_RB.cpu()
        warm, warm_experts = warm_maps(p_RB, home)
        moved_ER = moved_pairs(home_E, None if p_RB is None else p_RB.numpy(), R)
        return cls(c_RE, home_E, total_E.tolist(), load, warm, warm_experts,
                   previous_flows(prev_F3), moved_ER, (prev_RB, prev_F3))  # fmt: skip

    @classmethod
    def of_step(
        cls, step: Step, prev_RB: torch.Tensor | None, prev_F3: torch.Tensor | None
    ) -> Context:
        """:meth:`of` from the choice's screening view ``step`` (``screen.Step.of`` of the
        same counts, ``prev_RB`` and ``prev_F3``): its host counts, home map, loads,
        previous flows and slots, so one choice reads its inputs on the host once."""
        R = len(step.load_R)
        warm, warm_experts = resident_maps(step.slot_RB, step.home_E)
        previous = previous_flows(prev_F3) if step.previous is None else step.previous
        return cls(step.counts_RE, step.home_E, step.T_E.tolist(), step.load_R.tolist(),
                   warm, warm_experts, previous, moved_pairs(step.home_E, step.slot_RB, R),
                   (prev_RB, prev_F3))  # fmt: skip

    def alloc(self, target: list[int] | None, replay: bool, backend: str) -> np.ndarray:
        """int64 ``[E, R]``: the construction's allocation towards ``target`` (``None``:
        exact balance), replaying ``previous`` (its flows, its residents first) when
        ``replay``; ``backend``: ``"torch"`` (the host scans) or ``"reference"``."""
        if backend == "reference":
            counts = torch.from_numpy(self.counts_RE)
            prev = self.prev if replay else (None, None)
            B = 0 if prev[0] is None else prev[0].shape[1]
            return reference_fields(counts, B, 1, prev, target=target)["alloc"].numpy()
        R, E = len(self.load), len(self.total_E)
        t = targets_list(sum(self.total_E), R) if target is None else target
        warm = (self.warm, self.warm_experts) if replay else (None, {})
        previous = self.previous if replay else []
        return host_alloc(self.load, t, self.total_E, home_edges(E, R), warm, previous)[1]

    def time(self, cost: Any, alloc_ER: np.ndarray, planned: int) -> Any:
        """``cost.step_time`` of a plan of ``alloc_ER`` built on ``previous`` with
        ``planned`` runs: ``cost.plan_time(plan, planned=planned)``, without the plan."""
        fetch_ER = (alloc_ER > 0) & self.moved_ER
        return cost.step_time(alloc_ER, self.counts_RE, fetch_ER, self.home_E, planned=planned)


def resident_maps(
    slot_RB: np.ndarray | None, home_E: np.ndarray
) -> tuple[dict[int, set[int]] | None, dict[int, dict[int, list[int]]]]:
    """``group_flows.warm_maps`` of host slots ``slot_RB`` (int64 ``[R, B]``, ``-1``
    empty): the same maps, filled in the same order (receivers ascending, each one's
    experts ascending), from one sort of the resident pairs instead of a sort per rank."""
    if slot_RB is None:
        return None, {}
    r_N, j_N = (slot_RB >= 0).nonzero()
    e_N = slot_RB[r_N, j_N]
    order_N = np.lexsort((e_N, r_N))
    r_N, e_N = r_N[order_N], e_N[order_N]
    warm: dict[int, set[int]] = {}
    warm_experts: dict[int, dict[int, list[int]]] = {}
    for r, e, g in zip(r_N.tolist(), e_N.tolist(), home_E[e_N].tolist(), strict=True):
        warm.setdefault(r, set()).add(g)
        warm_experts.setdefault(g, {}).setdefault(r, []).append(e)
    return warm, warm_experts


def moved_pairs(home_E: np.ndarray, p_RB: np.ndarray | None, num_ranks: int) -> np.ndarray:
    """bool ``[E, R]``: ``r`` is not ``e``'s home and holds no previous slot of ``e``
    (``p_RB``: the previous slots on the host, or ``None``)."""
    E = len(home_E)
    moved_ER = np.ones((E, num_ranks), dtype=bool)
    moved_ER[np.arange(E), home_E] = False
    if p_RB is not None and p_RB.size:
        r_N, j_N = (p_RB >= 0).nonzero()
        moved_ER[p_RB[r_N, j_N], r_N] = False
    return moved_ER


def fetched_pairs(alloc_ER: torch.Tensor, prev_RB: torch.Tensor | None) -> np.ndarray:
    """bool ``[E, R]``: the replicas of ``alloc_ER`` not resident in ``prev_RB``'s slots
    (module docstring): what a plan of ``alloc_ER`` built on ``prev_RB`` fetches."""
    a_ER = alloc_ER.cpu().numpy()
    E, R = a_ER.shape
    p_RB = None if prev_RB is None else prev_RB.cpu().numpy()
    return (a_ER > 0) & moved_pairs(np.asarray(home_list(E, R), dtype=np.int64), p_RB, R)
