"""Steps before a trace: the per-expert loads a long-window policy learned from before it.

Legend:
    E experts    N steps before the trace that are known
    steps_N   int64 step numbers, ascending, all negative (-1: the step just before the
              trace's first step, which is step 0)
    totals_NE int64 records routed to each expert in each of those steps

A deployed EPLB plans from a window of 1000 steps and re-places every 3000
(``moonplan.baselines.eplb``). A trace of a few dozen measured steps cannot hold that, and
generating the window's full ``[R, E]`` counts is wasteful when only the per-expert totals
are read. A policy that plans from past loads says which steps it needs
(:meth:`UsesPrehistory.steps_before`); the simulator draws their totals from the same
routing law as the trace (``moonplan.simulate.workload.prehistory``) and hands them over
before the first step (:meth:`UsesPrehistory.prime`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Prehistory:
    """Per-expert totals of some steps before a trace (module docstring).

    Attributes:
        steps_N: int64 ``[N]``, strictly ascending, all ``< 0``.
        totals_NE: int64 ``[N, E]``, non-negative.
    """

    steps_N: torch.Tensor
    totals_NE: torch.Tensor

    def __post_init__(self) -> None:
        s, c = self.steps_N, self.totals_NE
        if s.dim() != 1 or c.dim() != 2 or c.shape[0] != s.shape[0]:
            raise ValueError(f"need steps [N] and totals [N, E], got {tuple(s.shape)}, "
                             f"{tuple(c.shape)}")  # fmt: skip
        if s.numel() and (bool((s >= 0).any()) or bool((s[1:] <= s[:-1]).any())):
            raise ValueError("prehistory steps must be negative and strictly ascending")
        if bool((c < 0).any()):
            raise ValueError("prehistory totals must be non-negative")

    @property
    def first(self) -> int:
        """The earliest step (0 when there is none)."""
        return int(self.steps_N[0]) if self.steps_N.numel() else 0

    def by_step(self) -> dict[int, torch.Tensor]:
        """``{step: total_E}`` (int64 ``[E]`` each)."""
        return dict(zip(self.steps_N.tolist(), self.totals_NE, strict=True))


def step_ranges(ranges: list[tuple[int, int]]) -> torch.Tensor:
    """int64 ``[N]``: the steps of the half-open ``(start, stop)`` ranges, sorted, each once."""
    steps = sorted({t for start, stop in ranges for t in range(start, stop)})
    return torch.tensor(steps, dtype=torch.int64)


@runtime_checkable
class UsesPrehistory(Protocol):
    """A policy that plans from the loads of steps before the trace (module docstring)."""

    def steps_before(self) -> list[tuple[int, int]]:
        """Half-open ``(start, stop)`` ranges of negative steps whose totals it reads."""
        ...

    def prime(self, before: Prehistory) -> None:
        """Take the totals of ``before`` as if it had run those steps (right after
        ``reset``; steps it is not given are steps it did not see)."""
        ...
