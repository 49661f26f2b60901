"""Per-record routing: where each of a rank's ``(token, k)`` records is executed.

Legend:
    R ranks, E experts, S tokens on this rank, K top-k, N_s = S*K records of this rank
    W rows per rank (see ``plan_type``)

Order (DESIGN §3): within expert ``e``, records are ordered by source rank,
then by local order (token-major, then k); destination ranks take consecutive
segments of that order in ascending rank order, of sizes ``alloc[e, :]``. Every
rank computes its own records' destinations from the plan alone, with no
further communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moonplan.errors import PlanError
from moonplan.plan.plan_type import Plan

_OFFSET_BITS = 40  # receive offsets stay far below 2**40 rows


@dataclass(frozen=True, eq=False)
class Route:
    """Destinations of one rank's records (int64 tensors on the plan's device).

    Attributes:
        dest_rank: ``[S, K]`` rank that executes each record.
        dest_offset: ``[S, K]`` row of the destination's expert-grouped,
            ``align``-padded receive buffer that the record is written to.
        send_counts: ``[R]`` records this rank sends to each rank.
        rank: the source rank.
    """

    dest_rank: torch.Tensor
    dest_offset: torch.Tensor
    send_counts: torch.Tensor
    rank: int

    def send_order(self) -> torch.Tensor:
        """``[S*K]`` flat record ids sorted by ``(dest_rank, dest_offset)``: the order in
        which an all-to-all transport packs its send buffer."""
        key_N = (self.dest_rank.reshape(-1) << _OFFSET_BITS) + self.dest_offset.reshape(-1)
        return torch.sort(key_N).indices


def route(plan: Plan, rank: int, topk_ids: torch.Tensor, *, check: bool = True) -> Route:
    """Destination rank and receive-buffer offset of each record of ``rank``.

    Args:
        plan: the step's plan.
        rank: this source rank, ``0 <= rank < R``.
        topk_ids: ``[S, K]`` integer expert ids of this rank's tokens (duplicates
            inside one token's top-k are separate records). Their per-expert counts
            must equal ``plan.counts[rank]``.
        check: validate ``topk_ids`` against the plan (reads values on the host; turn
            off for CUDA-graph capture once the inputs are known to be consistent).

    Raises:
        PlanError: bad rank, shape, ids out of range, or counts that differ from the plan.
    """
    R = plan.num_ranks
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < R:
        raise PlanError(f"rank must be an integer in [0, {R}), got {rank!r}")
    if check:
        _check_ids(plan, rank, topk_ids)
    ids_N = topk_ids.reshape(-1).to(device=plan.device, dtype=torch.int64)
    N = ids_N.numel()
    # This rank's records sorted by expert (stable: local order kept inside an expert).
    order_N = torch.sort(ids_N, stable=True).indices
    take_ER, base_ER = _cells(plan, rank)
    # Sorted records fill the cells (e, r) in (e, r) order: expert by expert, ranks ascending.
    cell_N = torch.repeat_interleave(
        torch.arange(take_ER.numel(), device=plan.device), take_ER.reshape(-1), output_size=N
    )
    dest_N = cell_N % R
    off_N = base_ER.reshape(-1)[cell_N] + torch.arange(N, device=plan.device)
    dest_rank = torch.empty_like(ids_N).scatter_(0, order_N, dest_N)
    dest_offset = torch.empty_like(ids_N).scatter_(0, order_N, off_N)
    S, K = topk_ids.shape
    return Route(
        dest_rank=dest_rank.view(S, K),
        dest_offset=dest_offset.view(S, K),
        send_counts=take_ER.sum(0),
        rank=rank,
    )


def _cells(plan: Plan, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per cell ``(e, r)``: records of ``rank`` it takes, and the offset base of its run.

    Expert ``e``'s records, in global order (source rank, then local order), are cut
    into segments ``[start, end)`` of sizes ``alloc[e, :]``; ``rank`` owns positions
    ``[lo, hi)`` of that order. A cell takes the overlap. ``base`` is such that the
    ``i``-th record in this rank's expert-sorted order, if it falls in the cell, lands
    at ``base + i`` of the destination's receive buffer.

    Returns:
        ``(take_ER, base_ER)``: int64 ``[E, R]`` each.
    """
    end_ER = torch.cumsum(plan.alloc, 1)
    start_ER = end_ER - plan.alloc
    lo_E = plan.counts[:rank].sum(0)
    hi_E = lo_E + plan.counts[rank]
    first_ER = torch.maximum(start_ER, lo_E[:, None])
    take_ER = (torch.minimum(end_ER, hi_E[:, None]) - first_ER).clamp(min=0)
    run_start_ER = (torch.cumsum(take_ER.reshape(-1), 0) - take_ER.reshape(-1)).view_as(take_ER)
    r_R = torch.arange(plan.num_ranks, device=plan.device)
    row_ER = row_index(plan).clamp(min=0)
    row_base_ER = plan.row_offset[r_R[None, :], row_ER]
    base_ER = row_base_ER + (first_ER - start_ER) - run_start_ER
    return take_ER, base_ER


def row_index(plan: Plan) -> torch.Tensor:
    """``[E, R]`` row of expert ``e`` in rank ``r``'s layout (``-1``: ``r`` does not execute it)."""
    R, E, W = plan.num_ranks, plan.num_experts, plan.num_rows
    dev = plan.device
    # Only executed rows matter (a slot may keep an unused resident); others go to a trash cell.
    live_RW = plan.row_count > 0
    r_RW = torch.arange(R, device=dev)[:, None]
    cell_RW = torch.where(live_RW, plan.row_expert.clamp(min=0) * R + r_RW, E * R)
    w_RW = torch.arange(W, device=dev)[None, :].expand(R, W)
    row_flat = torch.full((E * R + 1,), -1, dtype=torch.int64, device=dev)
    row_flat.scatter_(0, cell_RW.reshape(-1), w_RW.reshape(-1))
    return row_flat[: E * R].view(E, R)


def _check_ids(plan: Plan, rank: int, topk_ids: torch.Tensor) -> None:
    E = plan.num_experts
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise PlanError(
            f"topk_ids must be a 2-D [S, K] tensor, got {getattr(topk_ids, 'shape', topk_ids)}"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise PlanError(f"topk_ids must be integer expert ids, got dtype {topk_ids.dtype}")
    ids_N = topk_ids.reshape(-1).to(device=plan.device, dtype=torch.int64)
    if ids_N.numel() and (int(ids_N.min()) < 0 or int(ids_N.max()) >= E):
        raise PlanError(
            f"topk_ids must lie in [0, {E}); got range [{int(ids_N.min())}, {int(ids_N.max())}]"
        )
    got_E = torch.bincount(ids_N, minlength=E)
    if not torch.equal(got_E, plan.counts[rank]):
        e = int((got_E != plan.counts[rank]).nonzero()[0])
        raise PlanError(
            f"rank {rank}'s topk_ids route {int(got_E[e])} records to expert {e}, "
            f"but the plan was made with counts[{rank}, {e}] = {int(plan.counts[rank, e])}"
        )
