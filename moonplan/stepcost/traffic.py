"""Who sends how many dispatch rows to whom: per-rank volumes split by link.

Legend:
    R ranks    E experts    G ranks per NVLink domain (consecutive ranks share one)
    sent_RE  int64 rows source ``s`` sends towards expert ``e``
    rows_ER  int64 rows rank ``r`` computes for expert ``e`` (``sent_RE.sum(0) == rows_ER.sum(1)``)

Routing rule (moonplan's; ``moonplan/plan/README.md``, "Per-record routing"): within
expert ``e`` the rows are ordered by source rank, and destination ranks take
consecutive segments of that order in ascending rank. Source ``s`` owns ``[lo, hi)``
of that order, destination ``r`` owns another interval; what ``s`` sends to ``r`` is
their overlap. Because a
domain's ranks are consecutive, a whole domain also owns one interval, so the
rows that stay on a rank, stay inside its domain or cross the network are all
interval overlaps: ``O(R*E)`` work, no ``R x R`` matrix. Every policy is routed by
this rule (EPLB splits an expert over its replicas the same way).

Counts do not say which records of one token share a destination, so every
record carries its own ``H``-vector (DeepEP/MoonEP send a token once per rank:
real volumes can be lower).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Traffic:
    """Rows per rank (int64 numpy ``[R]``) of one dispatch, by link; combine is the reverse.

    numpy, not torch: these are a few small host vectors per prediction, and the planner's
    ``policy="auto"`` predicts several candidates per step (numpy's per-call overhead is
    several times lower than torch's on arrays this small).
    """

    local_R: np.ndarray
    send_intra_R: np.ndarray
    send_inter_R: np.ndarray
    recv_intra_R: np.ndarray
    recv_inter_R: np.ndarray


def host_int64(a: Any) -> np.ndarray:
    """``a`` (torch tensor on any device, numpy array or lists) as an int64 numpy array."""
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    return np.asarray(a, dtype=np.int64)


def _overlap(a_lo: np.ndarray, a_hi: np.ndarray, b_lo: np.ndarray, b_hi: np.ndarray) -> np.ndarray:
    return (np.minimum(a_hi, b_hi) - np.maximum(a_lo, b_lo)).clip(min=0)


def dispatch_traffic(sent_RE: Any, rows_ER: Any, domain: int) -> Traffic:
    """Per-rank rows kept local, sent/received inside the NVLink domain and across it.

    Args:
        sent_RE: int64 ``[R, E]`` (torch or numpy).
        rows_ER: int64 ``[E, R]`` with the same per-expert totals.
        domain: ``G >= 1`` ranks per NVLink domain (ranks ``[kG, (k+1)G)`` share one).
    """
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
    if domain >= R:  # one domain: everything not local is intra-domain
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


def pair_traffic(pairs_C2: Any, num_ranks: int, domain: int) -> Traffic:
    """Per-rank counts of whole-object transfers ``(source, destination)`` (weight copies)."""
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
