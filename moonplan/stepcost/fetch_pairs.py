"""Which ``(expert, rank)`` pairs fetch their weights in a step, from a plan's slot tables.

Legend:
    R ranks    E experts    B prefetch slots per rank    D direct-read rows per rank
    alloc_ER        int64 records of expert ``e`` rank ``r`` executes
    slot_expert_RB  int64 expert held by each prefetch slot, ``-1``: empty
    slot_new_RB     bool or int ``!= 0`` where the slot is (re)filled this step
    direct_RD       int64 expert each direct-read row reads in place, ``-1``: none
    fetch_ER        bool pairs whose weights must arrive on ``r`` before its rows run

A pair is fetched when a new slot or a direct read holds it and the rank runs rows of
it; home experts and residents kept from the previous step are not fetched. This is
what :meth:`moonplan.stepcost.StepCost.step_time` takes as ``fetch_ER``; the planner's
``moonplan.plan.plan_time`` reads the tables from a ``Plan``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moonplan.host_arrays import host_bool, host_int64


def fetch_pairs_ER(
    alloc_ER: np.ndarray, slot_expert_RB: Any, slot_new_RB: Any, direct_RD: Any
) -> np.ndarray:
    """bool numpy ``[E, R]`` of the fetched pairs (legend; ``alloc_ER`` int64 numpy on the
    host, the tables tensors on any device or arrays)."""
    fetch_ER = np.zeros(alloc_ER.shape, dtype=bool)
    slot_RB, new_RB = host_int64(slot_expert_RB), host_bool(slot_new_RB)
    r_N, j_N = new_RB.nonzero()
    fetch_ER[slot_RB[r_N, j_N], r_N] = True
    direct = host_int64(direct_RD)
    r_N, j_N = (direct >= 0).nonzero()
    fetch_ER[direct[r_N, j_N], r_N] = True
    fetch_ER &= alloc_ER > 0
    return fetch_ER
