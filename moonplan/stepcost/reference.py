"""Readable references of the step-cost arithmetic (tests compare the fast forms to these).

Legend:
    R ranks    E experts    G ranks per NVLink domain    C weight copies
    rows_ER   int64 rows rank ``r`` computes for expert ``e``
    sent_RE   int64 rows source ``s`` sends towards expert ``e``
    fetch_ER  bool  pairs whose weights arrive this step    src_E  int64 fetch source

:mod:`moonplan.stepcost.traffic` and :meth:`moonplan.stepcost.StepCost.step_time` compute
the same numbers in fewer array passes (one host copy of each input, both expert
sections at once, integer sums). These forms follow the definitions one quantity at a
time; every result must be equal to the last bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moonplan.host_arrays import host_int64
from moonplan.stepcost.step_cost import StepCost, StepTime
from moonplan.stepcost.traffic import Traffic


def _overlap(a_lo: np.ndarray, a_hi: np.ndarray, b_lo: np.ndarray, b_hi: np.ndarray) -> np.ndarray:
    return (np.minimum(a_hi, b_hi) - np.maximum(a_lo, b_lo)).clip(min=0)


def dispatch_traffic_reference(sent_RE: Any, rows_ER: Any, domain: int) -> Traffic:
    """``traffic.dispatch_traffic`` one interval overlap at a time (same arguments)."""
    sent_RE, rows_ER = host_int64(sent_RE), host_int64(rows_ER)
    R, E = sent_RE.shape
    if rows_ER.shape != (E, R) or not np.array_equal(sent_RE.sum(0), rows_ER.sum(1)):
        raise ValueError("sent_RE and rows_ER must be [R, E] and [E, R] with equal expert totals")
    rows_RE = rows_ER.T
    src_hi = sent_RE.cumsum(0)
    src_lo = src_hi - sent_RE
    dst_hi = rows_RE.cumsum(0)
    dst_lo = dst_hi - rows_RE
    local_R = _overlap(src_lo, src_hi, dst_lo, dst_hi).sum(1)
    first_R = np.arange(R) // domain * domain
    last_R = np.minimum(first_R + domain - 1, R - 1)
    if domain >= R:
        send_dom, recv_dom = sent_RE.sum(1), rows_RE.sum(1)
    else:
        send_dom = _overlap(src_lo, src_hi, dst_lo[first_R], dst_hi[last_R]).sum(1)
        recv_dom = _overlap(dst_lo, dst_hi, src_lo[first_R], src_hi[last_R]).sum(1)
    return Traffic(
        local_R=local_R,
        send_intra_R=send_dom - local_R,
        send_inter_R=sent_RE.sum(1) - send_dom,
        recv_intra_R=recv_dom - local_R,
        recv_inter_R=rows_RE.sum(1) - recv_dom,
    )


def pair_traffic_reference(pairs_C2: Any, num_ranks: int, domain: int) -> Traffic:
    """``traffic.pair_traffic`` one link class at a time (same arguments)."""
    pairs_C2 = host_int64(pairs_C2).reshape(-1, 2)
    src_C, dst_C = pairs_C2[:, 0], pairs_C2[:, 1]
    same_rank = src_C == dst_C
    same_dom = (src_C // domain) == (dst_C // domain)
    intra = same_dom & ~same_rank
    inter = ~same_dom

    def count(idx: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return np.bincount(idx[mask], minlength=num_ranks).astype(np.int64)

    return Traffic(
        local_R=count(src_C, same_rank),
        send_intra_R=count(src_C, intra),
        send_inter_R=count(src_C, inter),
        recv_intra_R=count(dst_C, intra),
        recv_inter_R=count(dst_C, inter),
    )


def experts_R_reference(
    cost: StepCost, rows_ER: Any, copies_R: np.ndarray | None = None
) -> np.ndarray:
    """``StepCost.experts_R`` in float arithmetic, as the module docstring states it
    (``copies_R``: weight copies each rank sends or receives beside these rows)."""
    rows = host_int64(rows_ER).astype(np.float64)
    tiles = np.ceil(rows / cost.tile_rows) * cost.tile_rows
    flop_R = cost.row_flop_s * tiles.sum(0)
    mem_R = cost.weight_read_s * (rows > 0).sum(0) + cost.row_mem_s * rows.sum(0)
    if copies_R is not None:
        mem_R = mem_R + cost.weight_read_s * copies_R
    return np.maximum(flop_R, mem_R)


def step_time_reference(cost: StepCost, *args: Any, planned: float = 1) -> StepTime:
    """``cost.step_time(rows_ER, sent_RE, fetch_ER, src_E, planned=...)`` (the ``"record"``
    dispatch) phase by phase, in the ``StepCost`` module docstring's order; the link
    phases are ``StepCost``'s own helpers, which the fast form shares."""
    rows_ER, sent_RE, fetch_ER, src_E = args
    rows, sent, src = host_int64(rows_ER), host_int64(sent_RE), host_int64(src_E)
    fetch = host_int64(fetch_ER) != 0
    R = rows.shape[1]
    G = cost.domain_size(R)
    data = dispatch_traffic_reference(sent, rows, G)
    e_C, r_C = fetch.nonzero()
    moves = pair_traffic_reference(np.stack([src[e_C], r_C], axis=1), R, G)
    plan = cost.plan_s * planned
    d_busy, w_busy = cost._busiest(data), cost._busiest(moves)
    D = cost._all_to_all(R, d_busy, cost.dispatch_row_s_intra, cost.dispatch_row_s_inter)
    Cb = cost._all_to_all(R, d_busy, cost.combine_row_s_intra, cost.combine_row_s_inter)
    beside = None
    if cost.overlap:  # each copy: a read at its sender, a write at its receiver
        away_C = src[e_C] != r_C
        beside = np.bincount(src[e_C][away_C], minlength=R) + np.bincount(r_C[away_C], minlength=R)
    home_R = experts_R_reference(cost, np.where(fetch, 0, rows), beside)
    wait_R = experts_R_reference(cost, np.where(fetch, rows, 0))
    return cost._schedule(plan, D, Cb, (home_R, wait_R), cost._fetch(w_busy, d_busy))
