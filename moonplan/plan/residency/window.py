"""The per-expert loads of the last ``W`` steps, kept on the counts' device.

Legend: R ranks, E experts, W window steps; ``loads_WE`` int64 ``[W, E]`` records per
step and expert (a ring: row ``t mod W`` holds step ``t``).

The slots follow this window, not one step's flows: a replica placed from ``W`` steps of
loads serves the persistent part of the popularity, and each step balances the rest
inside the replicas it has. Observing a step is one device reduction and one row write
(no host read); reading the window (:meth:`LoadWindow.totals_E`) is the placement's, off
the critical path.
"""

from __future__ import annotations

import torch

WINDOW = 32
"""Default ``W``: steps of loads the placement reads. Not tuned: on three real traces 8, 32
and 128 steps gave step times within 2.2% of each other (docs/benchmarks.md,
"Simulator: replicas that stay")."""


class LoadWindow:
    """A ring of the last ``window`` steps' per-expert loads (module docstring)."""

    def __init__(self, num_experts: int, window: int = WINDOW, device: torch.device | None = None):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.W, self.E = window, num_experts
        self.loads_WE = torch.zeros(window, num_experts, dtype=torch.int64, device=device)
        self.steps = 0  # steps observed (primed ones included)

    def observe(self, counts_RE: torch.Tensor) -> None:
        """Add one step's counts (int64 ``[R, E]``, on the window's device)."""
        self.loads_WE[self.steps % self.W] = counts_RE.sum(0)
        self.steps += 1

    def prime(self, totals_NE: torch.Tensor) -> None:
        """Add the per-expert totals of steps before the first (int64 ``[N, E]``, oldest
        first); only the last ``W`` matter."""
        for row in totals_NE[-self.W :]:
            self.loads_WE[self.steps % self.W] = row.to(self.loads_WE.device)
            self.steps += 1

    @property
    def filled(self) -> int:
        """Steps the window holds (at most ``W``)."""
        return min(self.steps, self.W)

    def loads(self) -> torch.Tensor:
        """int64 ``[filled, E]``: the per-expert loads of each step the window holds, the
        oldest first (one device op, no host read)."""
        if self.steps <= self.W:
            return self.loads_WE[: self.filled]
        return self.loads_WE.roll(-(self.steps % self.W), 0)

    def relabel(self, columns_E: torch.Tensor) -> None:
        """Take new expert labels: new column ``j`` is old column ``columns_E[j]`` (int64
        ``[E]``, a permutation)."""
        moved_WE = self.loads_WE.index_select(1, columns_E.to(self.loads_WE.device))
        self.loads_WE.copy_(moved_WE)  # in place: a normal tensor stays one (inference mode)

    def totals_E(self) -> torch.Tensor:
        """int64 ``[E]``: records per expert summed over the steps the window holds."""
        return self.loads_WE.sum(0)
