"""Two-stage token rows over all-to-alls: a token crosses to each destination host once.

Legend:
    R ranks, G ranks per host, S tokens of this rank, H hidden,
    U unique (token, destination rank) rows of this rank (``Route.unique_*``),
    V unique (token, destination host) rows of this rank,
    Q staging rows this rank holds as a proxy, M rows it forwards as a proxy,
    Y staging rows in use, B source blocks at this proxy, T token-buffer rows of
    this rank, X rows of one movement

Ranks ``h*G .. h*G + G - 1`` form host ``h``. A source ``s`` sends each of its tokens
once per destination host ``h``, to its *proxy* there, the rank of ``h`` with the
same local index (``h*G + s % G``), into that proxy's staging rows; with it go the
token's forwarding entries, one per destination rank of ``h`` (staging row,
destination, token-buffer row). The proxy then forwards each staged row inside its
host to the token buffers of those ranks: from there the step is the token-row data
path of :mod:`~moonplan.runtime.transports.tokens`. Combine runs it backwards: the
proxy reads its host's reduced rows of each staged token and sums them (ascending
destination, fp32, in x's dtype), the source reads one row per host and sums them
(ascending host). The backward moves ``dy`` and ``dx`` the same way.

Staging layout at a proxy (known to every source from the plan, no extra exchange):
one block per source with the proxy's local index, in source order; source ``s``'s
block has room for ``records(s, h)`` rows (``route_rows.pair_records`` summed over the
host's ranks), which bounds both its staged tokens and its forwarding entries. The
forwarding table is exchanged once a step, in dispatch, and serves every movement of
the step.

Rounding: a token's records are summed where they ran, then per host at the proxy,
then over hosts at the source, each partial sum in x's dtype: not the same bits as the
single-stage path (within the same tolerance; reruns are bit-identical).

Traffic (``StepState.traffic``, what this rank sent in dispatch and combine; the
backward moves the same rows the other way): ``rows_sent`` its rows of both stages
(``V + M``, its own rank included), ``rows_inter`` its stage-1 rows to other hosts
(one per (token, other host)), ``rows_intra`` its stage-2 rows to other ranks of its
host; ``bytes_inter`` / ``bytes_intra`` / ``bytes_sent`` the bytes to other hosts, to
other ranks of its host and in all: rows (both stages and both directions), 24
bytes per forwarding entry (three int64 words, one per (token, destination rank),
to the proxy) and 8 per record (token row and weight, straight to the executing
rank, as in :mod:`~moonplan.runtime.transports.tokens`). The all-to-all's own
addressing (``moonplan.comm.a2a`` sends an int64 offset per row) is not counted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from moonplan.comm.group import EPGroup
from moonplan.plan.plan_type import Plan
from moonplan.plan.route import Route
from moonplan.plan.route_rows import pair_records
from moonplan.runtime.row_ops import token_ops_for
from moonplan.runtime.row_ops.token_torch import Segments
from moonplan.runtime.transports.all_to_all import AllToAllRows, LocalRows
from moonplan.runtime.transports.base import StepState
from moonplan.runtime.transports.moves import Put
from moonplan.runtime.transports.tokens import TokenTransport


@dataclass(frozen=True, eq=False)
class Hops:
    """One step's two-stage addresses (int64; see the module docstring).

    Attributes:
        entry_dest_U: ``[U]`` the proxy each forwarding entry went to.
        stage_src_Q: ``[Q]`` the source of each staging row (-1: unused).
        token_V, proxy_V, stage_V: ``[V]`` this source's (token, host) rows: the token,
            its proxy rank and its staging row there (sorted by (host, token)).
        seg_V: the source's sum over hosts (:class:`Segments` of ``token_V``).
        num_stage: ``Q``, this rank's staging rows as a proxy.
        stage_M, dest_M, off_M: ``[M]`` the rows this rank forwards as a proxy: staging
            row, destination rank and its token-buffer row.
        seg_M: the proxy's sum over its host (:class:`Segments` of ``stage_M``).
        records_RR: ``[R, R]`` records each source sends each destination
            (``route_rows.pair_records`` of the step's plan; the stage rooms, the traffic).
    """

    entry_dest_U: Tensor
    stage_src_Q: Tensor
    token_V: Tensor
    proxy_V: Tensor
    stage_V: Tensor
    seg_V: Segments
    num_stage: int
    stage_M: Tensor
    dest_M: Tensor
    off_M: Tensor
    seg_M: Segments
    records_RR: Tensor


class TwoStageTokenTransport(AllToAllRows, TokenTransport):
    """Token rows over all-to-alls, once per destination host (see the module docstring).

    Args:
        ranks_per_host: ``G``; ``None`` reads ``LOCAL_WORLD_SIZE`` (set by ``torchrun``),
            else the whole group is one host. ``R`` must be a multiple of ``G``.
    """

    def __init__(
        self,
        group: EPGroup,
        capacity: int,
        hidden: int,
        dtype: torch.dtype,
        *,
        ranks_per_host: int | None = None,
    ):
        self.ranks_per_host = ranks_per_host_of(group.size, ranks_per_host)
        super().__init__(group, capacity, hidden, dtype)

    def _send_tokens(
        self, rows_SH: Tensor, route: Route, plan: Plan, state: StepState, extra: list[Put]
    ) -> None:
        """Collective: stage 1 to the proxies (with ``extra``), stage 2 inside each host."""
        hops = state.saved.get("hops") or self._hops(route, plan)
        state.saved["hops"] = hops
        stage = LocalRows(rows_SH.new_zeros(hops.num_stage, rows_SH.shape[1]))
        self.put_rows([Put(rows_SH[hops.token_V], hops.proxy_V, hops.stage_V, stage), *extra])
        fwd = Put(stage.local[hops.stage_M], hops.dest_M, hops.off_M, self.tokens)
        self.put_rows([fwd])

    def _fetch_tokens(self, route: Route, state: StepState) -> Tensor:
        """Collective: each proxy sums its host's rows of a staged token, each source
        its rows over hosts: ``[S, H]`` in x's dtype."""
        hops: Hops = state.saved["hops"]
        got_MH = self.fetch_rows(self.out, hops.dest_M, hops.off_M, check=False)
        ops = token_ops_for(got_MH.device)
        host_QH = ops.reduce_rows(got_MH, hops.seg_M, hops.num_stage, None, state.dtype)
        got_VH = self.fetch_rows(LocalRows(host_QH), hops.proxy_V, hops.stage_V, check=False)
        return ops.reduce_rows(got_VH, hops.seg_V, hops.seg_V.num_out, None, state.dtype)

    def _hops(self, route: Route, plan: Plan) -> Hops:
        """Collective: this step's addresses, the forwarding table exchanged once."""
        R, G, me = self.group.size, self.ranks_per_host, self.group.rank
        S, dev = route.dest_rank.shape[0], route.dest_rank.device
        dest_U = route.unique_dest
        host_U = dest_U // G
        key_V, v_of_U = torch.unique(host_U * S + route.unique_token, return_inverse=True)
        host_V, token_V = key_V // max(S, 1), key_V % max(S, 1)
        # Room of source s at the proxies of host h: records(s, h) rows.
        records_RR = pair_records(plan)
        room_RH = records_RR.view(R, R // G, G).sum(2)
        ranks_R = torch.arange(R, device=dev)
        peers_R = ranks_R % G == me % G  # the sources that share my proxies
        start_H = room_RH[peers_R & (ranks_R < me)].sum(0)  # my block at each host's proxy
        stage_V = start_H[host_V] + _rank_within(host_V, R // G)
        proxy_V = host_V * G + me % G
        entry_U = start_H[host_U] + _rank_within(host_U, R // G)
        num_stage = int(room_RH[peers_R, me // G].sum())
        table = LocalRows(torch.full((num_stage, 3), -1, dtype=torch.int64, device=dev))
        words_U3 = torch.stack([stage_V[v_of_U], dest_U, route.unique_offset], 1)
        self.put_rows([Put(words_U3, proxy_V[v_of_U], entry_U, table)])
        fwd_M3 = table.local[table.local[:, 0] >= 0]  # by source, then (dest, token)
        ops = token_ops_for(dev)
        block_end_B = torch.cumsum(room_RH[peers_R, me // G], 0)  # my proxy blocks, in order
        stage_src_Q = torch.full((num_stage,), -1, dtype=torch.int64, device=dev)
        used_Y = fwd_M3[:, 0].unique()
        src_Y = ranks_R[peers_R][torch.searchsorted(block_end_B, used_Y, right=True)]
        stage_src_Q[used_Y] = src_Y
        return Hops(
            entry_dest_U=proxy_V[v_of_U],
            stage_src_Q=stage_src_Q,
            token_V=token_V,
            proxy_V=proxy_V,
            stage_V=stage_V,
            seg_V=ops.segments(token_V, S, check=False),
            num_stage=num_stage,
            stage_M=fwd_M3[:, 0],
            dest_M=fwd_M3[:, 1],
            off_M=fwd_M3[:, 2],
            seg_M=ops.segments(fwd_M3[:, 0], num_stage),
            records_RR=records_RR,
        )

    def _traffic(self, route: Route, state: StepState, row: int) -> dict[str, int]:
        """This rank's rows and bytes of dispatch and combine by stage and link (module
        docstring): counted from the step's addresses."""
        hops: Hops = state.saved["hops"]
        me, G = self.group.rank, self.ranks_per_host
        # Combine: my reduced token rows go to the proxy of their source in my host.
        seg_P = state.saved["seg_P"]
        used_T = seg_P.offsets_T1.diff().view(-1) > 0
        src_T = _source_of_rows(hops.records_RR[:, me], used_T.numel())[used_T]
        moves = [  # (destination ranks, bytes each)
            (hops.proxy_V, row),  # stage 1
            (hops.entry_dest_U, 24),  # forwarding entries
            (route.dest_rank.reshape(-1), 8),  # per-record words
            (hops.dest_M, row),  # stage 2
            ((me // G) * G + src_T % G, row),  # combine: to the proxies
            (hops.stage_src_Q[hops.stage_src_Q >= 0], row),  # combine: to the sources
        ]
        counts_X2 = []  # per move: (to other hosts, to other ranks of my host)
        for dest_X, _ in moves:
            away_X = dest_X // G != me // G
            counts_X2.append(torch.stack([away_X.sum(), (~away_X & (dest_X != me)).sum()]))
        counts = torch.stack(counts_X2).tolist()  # one device sync
        size = [b for _, b in moves]
        return {
            "rows_sent": hops.proxy_V.numel() + hops.dest_M.numel(),
            "rows_inter": counts[0][0],
            "rows_intra": counts[3][1],
            "bytes_inter": sum(b * c[0] for b, c in zip(size, counts, strict=True)),
            "bytes_intra": sum(b * c[1] for b, c in zip(size, counts, strict=True)),
            "bytes_sent": sum(b * d.numel() for d, b in moves),
        }


def host_options(num_ranks: int) -> dict[str, object]:
    """The options a layer builds its ``a2a-hosts`` transports with: ``ranks_per_host``
    read from ``LOCAL_WORLD_SIZE`` (:func:`ranks_per_host_of`), once, when the layer is
    built; the layer agrees it across ranks (``moonplan.runtime.transports.registry``)."""
    return {"ranks_per_host": ranks_per_host_of(num_ranks, None)}


def ranks_per_host_of(num_ranks: int, given: int | None) -> int:
    """``G``: ``given``, else ``LOCAL_WORLD_SIZE``, else ``num_ranks`` (one host); raises
    ``ValueError`` unless it is a positive divisor of ``num_ranks``."""
    what = "ranks_per_host"
    if given is None:
        what, text = "LOCAL_WORLD_SIZE", os.environ.get("LOCAL_WORLD_SIZE", str(num_ranks))
        try:
            given = int(text)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {text!r}") from None
    if given < 1 or num_ranks % given:
        raise ValueError(f"{what} must divide the {num_ranks} ranks, got {given}")
    return given


def _source_of_rows(records_R: Tensor, num_rows: int) -> Tensor:
    """``[T]``: the source rank of each token-buffer row (blocks of ``records_R`` rows
    per source, in source order: ``moonplan/plan/route_rows.py``)."""
    end_R = torch.cumsum(records_R, 0)
    rows_T = torch.arange(num_rows, device=records_R.device)
    return torch.searchsorted(end_R, rows_T, right=True)


def _rank_within(group_X: Tensor, num_groups: int) -> Tensor:
    """``[X]``: each element's position among the elements of its group (``group_X``
    sorted ascending)."""
    count_G = torch.bincount(group_X, minlength=num_groups)
    first_G = torch.cumsum(count_G, 0) - count_G
    return torch.arange(group_X.numel(), device=group_X.device) - first_G[group_X]
