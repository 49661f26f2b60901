"""Random valid slot tables, for tests and benchmarks of what serves over slots.

Legend: E experts, R ranks, B slots per rank, T tables; ``slot_TRB`` int64 ``[T, R, B]``,
the expert in each slot (``-1``: empty).
"""

from __future__ import annotations

import torch

from moonplan.plan.home import home_list


def random_slot_tables(E: int, R: int, B: int, T: int, generator: torch.Generator) -> torch.Tensor:
    """int64 ``[T, R, B]``: ``T`` valid slot tables (``serving.check_slots``), every slot a
    random expert away from its rank's home experts, none twice on a rank (a rank with
    fewer than ``B`` such experts leaves the rest empty)."""
    home = home_list(E, R)
    slot_TRB = torch.full((T, R, B), -1, dtype=torch.int64)
    for t in range(T):
        for r in range(R):
            away_A = torch.tensor([e for e in range(E) if home[e] != r], dtype=torch.int64)
            pick_B = away_A[torch.randperm(len(away_A), generator=generator)[:B]]
            slot_TRB[t, r, : len(pick_B)] = pick_B
    return slot_TRB
