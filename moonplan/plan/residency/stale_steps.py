"""The ways of steps whose slots go stale (training), step by step.

Legend:
    S steps    R ranks    E experts    B slots per rank    W ways (:data:`STALE_WAYS`)
    rows_SRE   int64 ``[S, R, E]`` the steps scored, oldest first

Where the weights change at every step (training), no slot stays from one step to the
next, so no table is kept or targeted: each step is served from empty slots, by a lookup
(static EP, no call), a planner call, or the exact kernel
(``exact_way.exact_steps_s(chain=False)``). A decision in training scores the labels'
steps once (:func:`stale_steps`): the whole window gives the way of the next steps
(:meth:`StaleSteps.best`), and its newer half the seconds a re-home is weighed against
(``home_choice.stale_offer``), with no step built twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moonplan.plan.residency.exact_way import EXACT, exact_steps_s
from moonplan.plan.residency.serving import empty_slots
from moonplan.plan.residency.target import WAYS, scores_device, table_way_steps
from moonplan.plan.residency.window_torch import static_training_torch
from moonplan.plan.residency.work import Builds
from moonplan.stepcost import StepCost

STALE_WAYS = (*WAYS, EXACT)
"""The ways of a step with no slot kept, in tie-break order: those of an empty table
(``target.WAYS``), then the exact kernel."""


@dataclass(frozen=True)
class StaleSteps:
    """Each way's predicted seconds of each step with no slot kept (:func:`stale_steps`).

    Attributes:
        seconds_WS: per way of :data:`STALE_WAYS`, each step's seconds, oldest first.
        training: each step scored with its backward.
    """

    seconds_WS: tuple[tuple[float, ...], ...]
    training: bool = False

    def best(self, first: int = 0) -> tuple[float, str]:
        """The least predicted seconds of the steps from ``first`` on, and the way that
        gives it (the first of the least in :data:`STALE_WAYS` order). Each way's steps
        are summed as the window's scores sum them: the exact kernel's newest first."""
        sums = [sum(s_S[first:]) for s_S in self.seconds_WS[:-1]]
        sums.append(sum(reversed(self.seconds_WS[-1][first:])))
        w = min(range(len(STALE_WAYS)), key=lambda w: sums[w])
        return sums[w], STALE_WAYS[w]


def stale_steps(
    cost: StepCost,
    rows_SRE: torch.Tensor,
    num_slots: int,
    loads_SE: torch.Tensor | None = None,
    builds: Builds | None = None,
    training: bool = False,
) -> StaleSteps:
    """Each way's predicted seconds of each step of ``rows_SRE`` (int64 ``[S, R, E]``) with
    no slot kept (module docstring); the scores run on ``loads_SE``'s device (``None``:
    the host), ``builds`` counts the work. ``training``: each step is charged its backward
    too (``moonplan.stepcost.training``): an empty table's ways all serve static EP's
    plan (a call is charged its planning on top), so they add static EP's backward."""
    empty_1RB = empty_slots(rows_SRE.shape[1], num_slots)[None]
    static_S = back_S = None  # static EP scored once: its forward and, training, its backward
    if training:
        static_S, back_S = static_training_torch(cost, rows_SRE.to(scores_device(loads_SE)))
    table_WS = table_way_steps(cost, rows_SRE, empty_1RB, loads_SE, builds, static_S)[0]
    if back_S is not None:
        back = back_S.tolist()
        table_WS = [[s + b for s, b in zip(s_S, back, strict=True)] for s_S in table_WS]
    exact_S = exact_steps_s(cost, rows_SRE, empty_1RB[0], builds, False, training)[::-1]
    return StaleSteps(tuple(tuple(s_S) for s_S in (*table_WS, exact_S)), training)
