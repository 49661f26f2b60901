"""Routing: where each of a rank's ``(token, k)`` records is executed, and the
unique ``(token, destination rank)`` rows that carry them.

Legend:
    R ranks, E experts, S tokens on this rank, K top-k, N_s = S*K records of this rank
    W rows per rank (see ``plan_type``), U unique (token, destination) rows of this rank

Order (`docs/design.md` §3): within expert ``e``, records are ordered by source rank,
then by local order (token-major, then k); destination ranks take consecutive
segments of that order in ascending rank order, of sizes ``alloc[e, :]``. Every
rank computes its own records' destinations from the plan alone, with no
further communication. With ``affinity=True`` a source reorders only its own
records of a split expert inside its segment (``route_affinity``) so that a token
reaches fewer ranks; the token-buffer layout is in ``route_rows``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moonplan.errors import PlanError
from moonplan.host_arrays import host_int64
from moonplan.plan.plan_type import Plan
from moonplan.plan.route_affinity import affinity_cells
from moonplan.plan.route_host import OFFSET_BITS, counts_host, route_host, sort_keys
from moonplan.plan.route_rows import count_rows, token_block_start, unique_rows

HOST_FORM = True
"""Plain routing of CPU tensors takes the host form (``route_host``). ``False`` runs the
tensor form there too (the one an accelerator runs, no host read): what tests count."""


@dataclass(frozen=True, eq=False)
class Route:
    """Destinations of one rank's records (int64 tensors on the plan's device).

    Attributes:
        dest_rank: ``[S, K]`` rank that executes each record.
        dest_offset: ``[S, K]`` row of the destination's expert-grouped,
            ``align``-padded receive buffer that the record is written to.
        send_counts: ``[R]`` records this rank sends to each rank.
        rank: the source rank.
        affinity: the ``affinity`` argument of :func:`route` (with ``True`` the rows
            are the affinity rule's, or plain order's where that sends fewer rows).
        plan: the plan it routes (read by :attr:`block_start`).

    The unique ``(token, destination)`` rows (``unique_token``, ``unique_dest``,
    ``unique_offset``, ``record_unique``, ``unique_counts``, ``sent_rows``) are built on
    first use and kept: their count ``U`` is data-dependent, so building them reads one
    size on the host, which a caller that only needs per-record destinations (today's
    transports, CUDA-graph capture) never pays.
    """

    dest_rank: torch.Tensor
    dest_offset: torch.Tensor
    send_counts: torch.Tensor
    rank: int
    affinity: bool
    plan: Plan = field(repr=False)

    @functools.cached_property
    def block_start(self) -> torch.Tensor:
        """``[R]`` first row of this source's block in each destination's token buffer
        (``route_rows.token_block_start``); built on first use with the unique rows."""
        return token_block_start(self.plan, self.rank)

    @functools.cached_property
    def _rows(self) -> tuple[torch.Tensor, ...]:
        S, K = self.dest_rank.shape
        R = self.send_counts.numel()
        return unique_rows(self.dest_rank.reshape(-1), S, K, R, self.block_start)

    @property
    def unique_token(self) -> torch.Tensor:
        """``[U]`` token of each unique (token, destination) row, sorted by (destination, token)."""
        return self._rows[0]

    @property
    def unique_dest(self) -> torch.Tensor:
        """``[U]`` destination rank of each row."""
        return self._rows[1]

    @property
    def unique_offset(self) -> torch.Tensor:
        """``[U]`` row in the destination's token buffer (``route_rows``)."""
        return self._rows[2]

    @property
    def record_unique(self) -> torch.Tensor:
        """``[S, K]`` index in ``[0, U)`` of the row carrying each record."""
        return self._rows[3].view(self.dest_rank.shape)

    @property
    def unique_counts(self) -> torch.Tensor:
        """``[R]`` rows this rank sends to each rank."""
        return self._rows[4]

    @property
    def sent_rows(self) -> int:
        """(token, destination rank) rows this rank sends, its own rank included."""
        return int(self.unique_token.numel())

    def token_row(self) -> torch.Tensor:
        """``[S, K]`` int64: each record's row in its destination's token buffer, the
        int a transport writes at the record's ``dest_offset`` on that rank."""
        return self.unique_offset[self.record_unique]

    def send_order(self) -> torch.Tensor:
        """``[S*K]`` flat record ids sorted by ``(dest_rank, dest_offset)``: the order in
        which an all-to-all transport packs its send buffer."""
        key_N = (self.dest_rank.reshape(-1) << OFFSET_BITS) + self.dest_offset.reshape(-1)
        return torch.sort(key_N).indices


def route(
    plan: Plan, rank: int, topk_ids: torch.Tensor, *, check: bool = True, affinity: bool = False
) -> Route:
    """Destination rank and receive-buffer offset of each record of ``rank``.

    Args:
        plan: the step's plan.
        rank: this source rank, ``0 <= rank < R``.
        topk_ids: ``[S, K]`` integer expert ids of this rank's tokens (duplicates
            inside one token's top-k are separate records). Their per-expert counts
            must equal ``plan.counts[rank]``.
        check: validate ``topk_ids`` against the plan (reads values on the host; turn
            off for CUDA-graph capture once the inputs are known to be consistent).
        affinity: assign this rank's records of a split expert so that tokens reach
            few ranks (``route_affinity``; one host read, and several times the time of
            plain order: ``moonplan/plan/README.md``, "Per-record routing"). ``False``
            (the default): plain local order. Counts per (destination, expert) and the
            set of offsets are the same either way.

    The unique rows (``Route.unique_token`` ...) are built on first use (one host read).

    Raises:
        PlanError: bad rank, shape, ids out of range, or counts that differ from the plan.
    """
    R = plan.num_ranks
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < R:
        raise PlanError(f"rank must be an integer in [0, {R}), got {rank!r}")
    if check:
        _check_form(topk_ids)
    S, K = topk_ids.shape
    if not affinity and plan.device.type == "cpu" and HOST_FORM:
        ids_N = host_int64(topk_ids.reshape(-1))
        keys_N = sort_keys(ids_N, plan.num_experts)
        if check:
            lo_hi = (int(ids_N.min()), int(ids_N.max())) if ids_N.size else None
            _check_values(plan, rank, lo_hi, lambda: counts_host(ids_N, keys_N, plan.num_experts))
        out = route_host(plan, rank, keys_N)
        dest_N, offset_N, send_R = (torch.from_numpy(a) for a in out)
    else:
        if check:
            _check_tensor(plan, rank, topk_ids)
        dest_N, offset_N, send_R = _route_tensor(plan, rank, topk_ids, affinity)
    return Route(
        dest_rank=dest_N.view(S, K),
        dest_offset=offset_N.view(S, K),
        send_counts=send_R,
        rank=rank,
        affinity=affinity,
        plan=plan,
    )


def _route_tensor(
    plan: Plan, rank: int, topk_ids: torch.Tensor, affinity: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dest_N, offset_N, send_R)`` by tensor ops on the plan's device (no host read
    without ``affinity``): what :func:`route` returns, flat."""
    S, K = topk_ids.shape
    flat_N = topk_ids.reshape(-1).to(plan.device)
    # This rank's records sorted by expert (stable: local order kept inside an expert).
    # Narrow keys sort several times faster (fewer radix passes), in the same order.
    key_dtype = torch.int16 if plan.num_experts <= torch.iinfo(torch.int16).max else torch.int32
    order_N = torch.sort(flat_N.to(key_dtype), stable=True).indices
    take_C, base_C, dest_C, e_C = _row_cells(plan, rank)
    if affinity and flat_N.numel():
        cells = (take_C, base_C, dest_C, e_C)
        dest_N, offset_N = _affinity(order_N, cells, flat_N.to(torch.int64), plan, (S, K))
    else:
        dest_N, offset_N = _place_runs(order_N, take_C, base_C, dest_C)
    send_R = torch.zeros(plan.num_ranks, dtype=torch.int64, device=plan.device)
    return dest_N, offset_N, send_R.index_add_(0, dest_C, take_C)


def _place_runs(
    order_N: torch.Tensor, take_C: torch.Tensor, base_C: torch.Tensor, dest_C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N]`` destination rank and offset of each record (token-major) in plain order:
    the expert-sorted records ``order_N`` fill the cells in order, ``take_C`` each."""
    N, dev = order_N.numel(), order_N.device
    rank_N = torch.repeat_interleave(dest_C, take_C, output_size=N)
    off_N = torch.repeat_interleave(base_C, take_C, output_size=N)
    off_N += torch.arange(N, device=dev)
    dest_rank = torch.empty(N, dtype=torch.int64, device=dev).scatter_(0, order_N, rank_N)
    dest_offset = torch.empty(N, dtype=torch.int64, device=dev).scatter_(0, order_N, off_N)
    return dest_rank, dest_offset


def _affinity(
    order_N: torch.Tensor,
    cells: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ids_N: torch.Tensor,
    plan: Plan,
    tokens: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_place_runs` under the affinity rule (``route_affinity``), or plain order
    where that sends fewer rows (one host read). ``tokens`` is ``(S, K)``."""
    take_C, base_C, dest_C, e_C = cells
    (S, K), N, R = tokens, order_N.numel(), plan.num_ranks
    cell_N = torch.repeat_interleave(
        torch.arange(take_C.numel(), device=plan.device), take_C, output_size=N
    )
    dest_rank, dest_offset = _place(order_N, cell_N, base_C, dest_C)
    moved = affinity_cells(
        cell_N, ids_N[order_N], order_N // K, take_C, e_C, dest_C, plan.num_experts, R, S
    )
    if moved is None:
        return dest_rank, dest_offset
    # Regroup the split experts' records by cell, local order kept inside a cell
    # (stable); the other records already sit in their cells' runs.
    idx_P, cell_P = moved
    regroup_P = torch.sort(cell_P, stable=True).indices
    order_N, cell_N = order_N.clone(), cell_N.clone()
    order_N[idx_P] = order_N[idx_P[regroup_P]]
    cell_N[idx_P] = cell_P[regroup_P]
    aff_rank, aff_offset = _place(order_N, cell_N, base_C, dest_C)
    # The greedy rule can lose to plain order; never send more rows than it.
    fewer = count_rows(aff_rank, S, K, R) <= count_rows(dest_rank, S, K, R)
    if bool(fewer):  # one host read
        return aff_rank, aff_offset
    return dest_rank, dest_offset


def _place(
    order_N: torch.Tensor, cell_N: torch.Tensor, base_C: torch.Tensor, dest_C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N]`` destination rank and offset of each record (token-major) when the
    expert-sorted records ``order_N`` take the cells ``cell_N`` (runs in cell order)."""
    N, dev = order_N.numel(), order_N.device
    off_N = base_C.index_select(0, cell_N) + torch.arange(N, device=dev)
    dest_rank = torch.empty(N, dtype=torch.int64, device=dev)
    dest_rank.scatter_(0, order_N, dest_C.index_select(0, cell_N))
    dest_offset = torch.empty(N, dtype=torch.int64, device=dev).scatter_(0, order_N, off_N)
    return dest_rank, dest_offset


def _row_cells(
    plan: Plan, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``rank`` sends to every row of every rank, rows sorted by (expert, rank).

    Lay all records on one line: experts in id order, inside an expert by source
    rank, then local order. The rows executing expert ``e`` (ascending rank) cut
    ``e``'s stretch into consecutive segments of ``row_count`` records; ``rank``
    owns the positions ``[lo, hi)`` of that stretch. A row takes the overlap.

    Returns:
        ``(take_C, base_C, dest_C, e_C)`` over the ``C = R*W`` rows sorted by (expert,
        rank): records of ``rank`` the row takes; an offset base such that the
        ``i``-th record of this rank's expert-sorted order, if it falls in the row,
        lands at ``base + i`` of the destination's receive buffer; the row's rank;
        its expert (0 for empty rows, which take nothing).
    """
    R, W = plan.num_ranks, plan.num_rows
    e_RW, count_RW = plan.row_expert, plan.row_count
    r_RW = torch.arange(R, device=plan.device)[:, None].expand(R, W)
    key_C = torch.where(count_RW > 0, e_RW * R + r_RW, -1).reshape(-1)  # empty rows first
    order_C = torch.argsort(key_C)
    dest_C = order_C // W
    e_C = e_RW.reshape(-1).index_select(0, order_C).clamp_(min=0)
    count_C = count_RW.reshape(-1).index_select(0, order_C)
    end_C = torch.cumsum(count_C, 0)
    start_C = end_C - count_C  # the row's segment on the line
    T_E = plan.counts.sum(0)
    lo_E = torch.cumsum(T_E, 0) - T_E + plan.counts[:rank].sum(0)
    lo_C = lo_E.index_select(0, e_C)
    hi_C = lo_C + plan.counts[rank].index_select(0, e_C)
    first_C = torch.maximum(start_C, lo_C)
    take_C = (torch.minimum(end_C, hi_C) - first_C).clamp_(min=0)
    run_C = torch.cumsum(take_C, 0) - take_C  # where the row's records start in sorted order
    # row_offset is [R, W + 1]: row (r, w) starts at flat index r * (W + 1) + w
    row_base_C = plan.row_offset.reshape(-1).index_select(0, order_C + dest_C)
    base_C = row_base_C + (first_C - start_C) - run_C
    return take_C, base_C, dest_C, e_C


def _check_form(topk_ids: torch.Tensor) -> None:
    """PlanError unless ``topk_ids`` is a 2-D integer tensor."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        got = tuple(topk_ids.shape) if isinstance(topk_ids, torch.Tensor) else topk_ids
        raise PlanError(f"topk_ids must be a 2-D [S, K] tensor, got {got}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise PlanError(f"topk_ids must be integer expert ids, got dtype {topk_ids.dtype}")


def _check_tensor(plan: Plan, rank: int, topk_ids: torch.Tensor) -> None:
    """:func:`_check_values` of ``topk_ids`` by tensor ops on the plan's device."""
    ids_N = topk_ids.reshape(-1).to(device=plan.device, dtype=torch.int64)
    lo_hi = None
    if ids_N.numel():
        lo, hi = torch.stack(list(torch.aminmax(ids_N))).tolist()  # one host read
        lo_hi = (lo, hi)
    _check_values(plan, rank, lo_hi, lambda: torch.bincount(ids_N, minlength=plan.num_experts))


def _check_values(
    plan: Plan, rank: int, lo_hi: tuple[int, int] | None, count: Callable[[], torch.Tensor]
) -> None:
    """PlanError unless the ids' range ``lo_hi`` (``None``: no ids) lies in ``[0, E)`` and
    their records per expert ``count()`` (called only then) equal ``plan.counts[rank]``."""
    E = plan.num_experts
    if lo_hi is not None and (lo_hi[0] < 0 or lo_hi[1] >= E):
        raise PlanError(f"topk_ids must lie in [0, {E}); got range [{lo_hi[0]}, {lo_hi[1]}]")
    got_E, want_E = count().to(plan.device), plan.counts[rank]
    if not torch.equal(got_E, want_E):
        e = int((got_E != want_E).nonzero()[0])
        raise PlanError(
            f"rank {rank}'s topk_ids route {int(got_E[e])} records to expert {e}, "
            f"but the plan was made with counts[{rank}, {e}] = {int(want_E[e])}"
        )
