"""The interface every balancing policy implements: :class:`Policy` and its :class:`PolicyStep`.

Legend:
    R ranks    E experts    C weight copies moved in one step
    counts_RE  int64 records source rank ``s`` routes to expert ``e`` (one step, all-gathered)
    alloc_ER   int64 records of expert ``e`` that rank ``r`` executes (real records only)
    rows_ER    int64 rows rank ``r`` computes for expert ``e`` (``alloc_ER`` plus padding)
    sent_RE    int64 rows source ``s`` sends towards expert ``e`` (counts minus drops, plus padding)
    moves_C2   int64 ``(source rank, destination rank)`` of each expert-weight copy moved

It sits below every policy module and the registry (``moonplan.baselines.registry``),
which every policy module registers itself in, so there is no import cycle
(docs/design.md §5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moonplan.plan.validate import as_counts

__all__ = ["Policy", "PolicyStep", "make_step", "no_moves"]


def no_moves() -> torch.Tensor:
    """An empty ``[0, 2]`` moves tensor."""
    return torch.zeros(0, 2, dtype=torch.int64)


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
            Unless given: no drops, no copies, no moves.
        copies: expert weight instances executed off their primary holder this step
            (replica pairs for home-based policies; redundant experts held for EPLB).
        moves_C2: ``[C, 2]`` weight copies that must arrive before this step's experts
            run (source rank, destination rank): moonplan's and the greedy's prefetch.
        background_C2: ``[C', 2]`` weight copies moved off the critical path
            (EPLB's periodic rearrangement), of which a share ``background_share`` is
            copied beside this step (the simulator charges its link time).
        background_share: the part of ``background_C2`` beside this step (EPLB spreads a
            rearrangement's moves over several steps: ``1 / spread``).
        fetch_ER: bool ``[E, R]`` pairs whose weights must arrive before their rows run
            this step (the expert of each ``moves_C2`` copy); ``None``: none.
        src_E: ``[E]`` rank each expert's weights are fetched from; ``None``: no fetch.
        planned: planner runs on the critical path this step (construction equivalents:
            ``moonplan-auto`` adds its choice's own work, ``Plan.choice``).
        choice: the candidate a choosing policy took this step (``moonplan-auto``:
            ``plan.policy``, e.g. ``"static"``); ``""`` for the others.
        refill_ER: bool ``[E, R]`` pairs copied into staging rows beside this step
            (``moonplan-auto``'s slot refill; each from ``src_E``); ``None``: none.
        local_copies: expert weights copied within one rank on the critical path this
            step, on the busiest rank (a refill's staging rows swapped into its slots).
        blocking_s: seconds of copies on the critical path before this step
            (``moonplan-auto``'s re-home: its rows' link time, between two steps).
    """

    name: str
    alloc_ER: torch.Tensor
    rows_ER: torch.Tensor
    sent_RE: torch.Tensor
    dropped: int = 0
    copies: int = 0
    moves_C2: torch.Tensor = field(default_factory=no_moves)
    background_C2: torch.Tensor = field(default_factory=no_moves)
    background_share: float = 1.0
    fetch_ER: torch.Tensor | None = None
    src_E: torch.Tensor | None = None
    planned: float = 1
    choice: str = ""
    refill_ER: torch.Tensor | None = None
    local_copies: int = 0
    blocking_s: float = 0.0

    @property
    def load_R(self) -> torch.Tensor:
        """``[R]`` real records each rank executes."""
        return self.alloc_ER.sum(0)

    @property
    def new_copies(self) -> float:
        """Expert weights moved this step (blocking, the background share and refilled)."""
        refilled = 0 if self.refill_ER is None else int(self.refill_ER.sum())
        background = self.background_C2.shape[0] * self.background_share
        return self.moves_C2.shape[0] + background + refilled

    def moved_bytes(self, expert_bytes: float) -> float:
        """Bytes of expert weights moved this step, given one expert's bytes (``3*H*F*s``)."""
        return self.new_copies * float(expert_bytes)


def make_step(
    name: str, counts_RE: torch.Tensor, alloc_ER: torch.Tensor, **fields: Any
) -> PolicyStep:
    """A dropless, unpadded :class:`PolicyStep` (rows = alloc, sent = counts); ``fields``
    are its other attributes (``copies``, ``moves_C2``, ``fetch_ER``, ...)."""
    return PolicyStep(name, alloc_ER, alloc_ER, counts_RE, **fields)


class Policy:
    """Base class: a named policy for ``R`` ranks and ``E`` experts (see module docstring)."""

    name = "policy"
    home_order: tuple[int, ...] | None = None
    """The model's experts in home order where the policy relabels them (its steps'
    expert ids are labels: label ``i`` is expert ``home_order[i]``); ``None``: as given."""

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
