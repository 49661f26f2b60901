"""The torch backend's host form: the reference plan, bit for bit, from host integers.

Legend: R ranks, E experts, B slots, M = ceil(E/R), F = R - 1 flow rows.

Steps 1-2 run as heap scans over Python integers (``group_flows``), step 3 as numpy on
``[R, M]`` arrays (``host_layout``): one numpy copy of the counts goes in, one tensor per
field comes out (a view of its numpy array on the CPU). ``torch_backend.plan_torch`` takes
this form for CPU tensors (``scan="host"``), where reading a value costs nothing and a
Python or numpy step costs less than a tensor op. It works on any device (the counts are
read to the host, the fields copied back), but only the CPU gains from it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from moonplan.host_arrays import host_int64
from moonplan.plan.group_flows import HostMoves, host_moves, warm_maps
from moonplan.plan.home import home_edges, max_local, targets_list
from moonplan.plan.host_layout import candidates_from_moves, place_slots_host_np, row_layout_host
from moonplan.plan.plan_fields import PlanFields, padded_flows
from moonplan.plan.reference import previous_flows


@dataclass(frozen=True)
class HostHome:
    """The home layout of one ``(E, R)`` as host arrays (int64, read-only: kept per shape
    by :func:`host_home`, since a layer plans the same shape every step).

    Attributes:
        edges: ``[R + 1]`` ints, rank ``r``'s home experts ``[edges[r], edges[r + 1])``.
        home_E: each expert's home rank (``home.home_map``).
        ids_RM: each rank's home experts, padded with ``E`` (``from_alloc.home_layout``).
        rows_RM: the same, padded with ``-1`` (the home rows of the row layout).
        cell_E: ``e * R + home_E[e]``, each expert's home cell in a flat ``[E, R]``.
    """

    edges: list[int]
    home_E: np.ndarray
    ids_RM: np.ndarray
    rows_RM: np.ndarray
    cell_E: np.ndarray


@functools.lru_cache(maxsize=64)
def host_home(num_experts: int, num_ranks: int) -> HostHome:
    """:class:`HostHome` of ``(E, R)``, built once per shape."""
    E, R = num_experts, num_ranks
    edges = home_edges(E, R)
    size_R = np.diff(edges)
    ids_RM = np.full((R, max_local(E, R)), E, dtype=np.int64)
    ids_RM[np.arange(ids_RM.shape[1]) < size_R[:, None]] = np.arange(E)  # groups in order
    home_E = np.repeat(np.arange(R, dtype=np.int64), size_R)
    home = HostHome(
        edges, home_E, ids_RM, np.where(ids_RM < E, ids_RM, -1), np.arange(E) * R + home_E
    )
    for a in (home.home_E, home.ids_RM, home.rows_RM, home.cell_E):
        a.flags.writeable = False
    return home


@dataclass(frozen=True)
class HostSteps12:
    """Steps 1-2 on the host: the targets (int64 ``[R]``), the group flows and step 2's
    moves (``group_flows.HostMoves``), and the allocation (int64 ``[E, R]``)."""

    target: np.ndarray
    split: HostMoves
    alloc_ER: np.ndarray


def steps12_host(
    counts_RE: torch.Tensor,
    prev_RB: torch.Tensor | None,
    prev_F3: torch.Tensor | None,
    target_R: torch.Tensor | None = None,
) -> HostSteps12:
    """Steps 1-2 (``reference.balance_groups`` and ``split_group``) over host integers.

    Args:
        counts_RE: int64 ``[R, E]`` validated counts (any device; read once).
        prev_RB: int64 ``[R, B]`` previous slots, or ``None``.
        prev_F3: int64 ``[R-1, 3]`` previous flows (``-1`` padded), or ``None``.
        target_R: int64 ``[R]`` targets replacing the exact ones, or ``None``.
    """
    c = host_int64(counts_RE)
    R, E = c.shape
    home = host_home(E, R)
    T_E = c.sum(0)
    T_E1 = np.concatenate([[0], np.cumsum(T_E)])  # records of the experts before e
    load = (T_E1[home.edges[1:]] - T_E1[home.edges[:-1]]).tolist()
    target = targets_list(sum(load), R) if target_R is None else host_int64(target_R).tolist()
    warm = (None, {}) if prev_RB is None else warm_maps(prev_RB, home.home_E.tolist())
    steps = host_moves(load, target, T_E.tolist(), home.edges, warm, previous_flows(prev_F3))
    alloc_ER = np.zeros(E * R, dtype=np.int64)
    if steps.moves:
        e_X, r_X, q_X = np.array(steps.moves, dtype=np.int64).T
        alloc_ER[e_X * R + r_X] = q_X
    alloc_ER[home.cell_E] = steps.remaining  # no move went home
    return HostSteps12(np.array(target, dtype=np.int64), steps, alloc_ER.reshape(E, R))


def plan_host(
    counts_RE: torch.Tensor,
    num_slots: int,
    align: int,
    prev_RB: torch.Tensor | None,
    prev_F3: torch.Tensor | None = None,
    target_R: torch.Tensor | None = None,
) -> PlanFields:
    """The plan's layout tensors (``torch_backend.plan_torch``'s, bit for bit) on the counts'
    device. Arguments as :func:`steps12_host`; ``num_slots`` is ``B``, ``align`` the row
    padding multiple."""
    R, E = counts_RE.shape
    steps = steps12_host(counts_RE, prev_RB, prev_F3, target_R)
    home = host_home(E, R)
    cand_RM = candidates_from_moves(steps.split.moves, R, home.ids_RM.shape[1])
    prev = None if prev_RB is None else host_int64(prev_RB)
    slot_RB, new_RB, direct_RD = place_slots_host_np(cand_RM, prev, num_slots)
    rows = row_layout_host(home.rows_RM, slot_RB, direct_RD, steps.alloc_ER, align)
    fields = PlanFields(
        alloc=torch.from_numpy(steps.alloc_ER),
        target=torch.from_numpy(steps.target),
        home=torch.from_numpy(home.home_E.copy()),  # a field of the plan: not the kept array
        flow=padded_flows(steps.split.flows, R),
        slot_expert=torch.from_numpy(slot_RB),
        slot_new=torch.from_numpy(new_RB),
        row_expert=torch.from_numpy(rows[0]),
        row_count=torch.from_numpy(rows[1]),
        row_offset=torch.from_numpy(rows[2]),
    )
    if counts_RE.device.type != "cpu":
        fields = fields.to(counts_RE.device)
    return fields if target_R is None else fields._replace(target=target_R)
