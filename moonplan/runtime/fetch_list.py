"""``FetchList``: the weight rows one rank copies in a step, read from its plan once.

Legend:
    R ranks, E experts, M home rows per rank, B slots, N new slots of this rank
    (``N <= B``), D direct rows of this rank (replicas beyond its ``B`` slots, read in
    place), C = N + D rows this rank copies, W = M + B + D rows per rank

The prefetch needs, for this rank, the slots to (re)fill (``Plan.slot_new``) and
the direct rows (``Plan.direct_expert``), each with the home rank and home row of
its expert. :func:`fetch_list` reads the plan's slot and direct rows of every rank
in **one** host read and works the rest out on the host from a :class:`HomeRows`
map built once per expert store: no index tensors are built and nothing else is
read back on the step's critical path (on CUDA, one device-to-host copy). The same
read (:func:`plan_rows`) carries every rank's row offsets: the receive sizes the
buffers are sized by, and this rank's section bounds (:func:`row_offsets`), so its
grouped GEMMs read nothing of their own. The background job then turns the list into
index tensors (:meth:`FetchList.index`), off the critical path.

:func:`fetch_list_reference` is the readable spec (torch ops on the plan's tensors,
the home map of ``moonplan.plan.home``); tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moonplan.plan.home import home_list, home_start
from moonplan.plan.plan_type import Plan


@dataclass(frozen=True)
class HomeRows:
    """Host map of every expert to its home rank and its row there (``E`` entries each).

    Attributes:
        rank_E: home rank of each expert.
        row_E: row of each expert among its home rank's home rows.
    """

    rank_E: tuple[int, ...]
    row_E: tuple[int, ...]

    @classmethod
    def of(cls, num_experts: int, num_ranks: int) -> HomeRows:
        """The linear home map of ``E`` experts over ``R`` ranks (``moonplan.plan.home``)."""
        rank_E = home_list(num_experts, num_ranks)
        row_E = [e - home_start(h, num_experts, num_ranks) for e, h in enumerate(rank_E)]
        return cls(tuple(rank_E), tuple(row_E))


@dataclass(frozen=True)
class FetchList:
    """This rank's copies under one plan (host integers: no tensors, no device).

    Attributes:
        slot_N: the slots to fill, ascending (indices in ``[0, B)``).
        slot_rank_N, slot_row_N: home rank and home row of each new slot's expert.
        direct_rank_D, direct_row_D: home rank and home row of each direct row's
            expert, in row order.
        group: whether any rank of the group copies anything under this plan (what a
            collective transport needs: every rank joins its fetch, or none does).
    """

    slot_N: tuple[int, ...]
    slot_rank_N: tuple[int, ...]
    slot_row_N: tuple[int, ...]
    direct_rank_D: tuple[int, ...]
    direct_row_D: tuple[int, ...]
    group: bool

    @property
    def mine(self) -> bool:
        """Whether this rank fills a slot or reads a direct row."""
        return bool(self.slot_N or self.direct_rank_D)

    def index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(slot_N, src_rank_C, src_row_C)`` int64 on ``device``: the new slots, then the
        sources of the new slots' rows followed by the direct rows'.

        Built on the host and moved in one copy; on CUDA from pinned memory without
        blocking (the side stream may still wait for the step's earlier work).
        """
        N, C = len(self.slot_N), len(self.slot_N) + len(self.direct_rank_D)
        ranks = (*self.slot_rank_N, *self.direct_rank_D)
        rows = (*self.slot_row_N, *self.direct_row_D)
        flat = torch.tensor([*self.slot_N, *ranks, *rows], dtype=torch.int64)
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        else:
            flat = flat.to(device)
        return flat[:N], flat[N : N + C], flat[N + C :]


def plan_rows(p: Plan) -> np.ndarray:
    """int64 numpy ``[R, 2B + D + W + 1]``: each rank's new-slot flags ``[B]``, slots'
    experts ``[B]``, direct rows' experts ``[D]`` (``-1``: none) and row offsets ``[W + 1]``
    (``Plan.row_offset``; the last is its receive rows, ``Plan.recv_size``), in one host
    read (a device-to-host copy where ``p`` lives on an accelerator): what the layer reads
    of a plan each step (its buffer size, its fetch list and its expert sections' rows,
    :func:`row_offsets`)."""
    parts = [p.slot_new.to(torch.int64), p.slot_expert, p.direct_expert(), p.row_offset]
    return torch.cat(parts, 1).cpu().numpy()


def row_offsets(plan: Plan, rank: int, rows: np.ndarray) -> tuple[int, ...]:
    """``plan.row_offset[rank]`` (``W + 1`` host integers) from the read of
    :func:`plan_rows` (``rows``, int64 ``[R, 2B + D + W + 1]``): where each of ``rank``'s
    rows starts in its receive buffer, for the expert sections (no read of its own)."""
    width = plan.row_offset.shape[1]
    return tuple(int(v) for v in rows[rank, -width:].tolist())


def fetch_list(plan: Plan, rank: int, home: HomeRows, rows: np.ndarray | None = None) -> FetchList:
    """``rank``'s copies under ``plan`` (the first ``2B + D`` columns of one host read,
    :func:`plan_rows`).

    Args:
        plan: the step's plan (tensors on any device).
        rank: this rank.
        home: the home map of the plan's ``E`` experts over its ``R`` ranks.
        rows: that read if the caller already made it, else it is made here.
    """
    B, D = plan.num_slots, plan.direct_expert().shape[1]
    rows_R = (plan_rows(plan) if rows is None else rows)[:, : 2 * B + D].tolist()
    group = any(any(n > 0 for n in r[:B]) or any(e >= 0 for e in r[2 * B :]) for r in rows_R)
    row = rows_R[rank]
    slot_N = [b for b in range(B) if row[b] > 0]
    e_N = [row[B + b] for b in slot_N]
    e_D = [e for e in row[2 * B :] if e >= 0]
    return FetchList(
        tuple(slot_N),
        tuple(home.rank_E[e] for e in e_N),
        tuple(home.row_E[e] for e in e_N),
        tuple(home.rank_E[e] for e in e_D),
        tuple(home.row_E[e] for e in e_D),
        group,
    )


def fetch_list_reference(plan: Plan, rank: int) -> FetchList:
    """:func:`fetch_list` with torch ops on the plan's tensors (its home map, the home
    starts of ``moonplan.plan.home``): the readable spec."""
    R, E = plan.num_ranks, plan.num_experts
    starts = torch.tensor([home_start(r, E, R) for r in range(R)], device=plan.device)
    new_N = (plan.slot_new[rank] > 0).nonzero().flatten()
    e_N = plan.slot_expert[rank][new_N]
    d_D = plan.direct_expert()[rank]
    e_D = d_D[d_D >= 0]
    group = bool((plan.slot_new > 0).any()) or bool((plan.direct_expert() >= 0).any())
    h_N, h_D = plan.home[e_N], plan.home[e_D]
    return FetchList(
        tuple(new_N.tolist()),
        tuple(h_N.tolist()),
        tuple((e_N - starts[h_N]).tolist()),
        tuple(h_D.tolist()),
        tuple((e_D - starts[h_D]).tolist()),
        group,
    )
