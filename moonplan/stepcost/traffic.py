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

import torch


@dataclass(frozen=True)
class Traffic:
    """Rows per rank (int64 ``[R]``) of one dispatch, by link; combine is the reverse."""

    local_R: torch.Tensor
    send_intra_R: torch.Tensor
    send_inter_R: torch.Tensor
    recv_intra_R: torch.Tensor
    recv_inter_R: torch.Tensor


def _overlap(
    a_lo: torch.Tensor, a_hi: torch.Tensor, b_lo: torch.Tensor, b_hi: torch.Tensor
) -> torch.Tensor:
    return (torch.minimum(a_hi, b_hi) - torch.maximum(a_lo, b_lo)).clamp(min=0)


def dispatch_traffic(sent_RE: torch.Tensor, rows_ER: torch.Tensor, domain: int) -> Traffic:
    """Per-rank rows kept local, sent/received inside the NVLink domain and across it.

    Args:
        sent_RE: int64 ``[R, E]``.
        rows_ER: int64 ``[E, R]`` with the same per-expert totals.
        domain: ``G >= 1`` ranks per NVLink domain (ranks ``[kG, (k+1)G)`` share one).
    """
    R, E = sent_RE.shape
    if rows_ER.shape != (E, R) or not torch.equal(sent_RE.sum(0), rows_ER.sum(1)):
        raise ValueError("sent_RE and rows_ER must be [R, E] and [E, R] with equal expert totals")
    rows_RE = rows_ER.t().contiguous()
    src_hi = sent_RE.cumsum(0)
    src_lo = src_hi - sent_RE
    dst_hi = rows_RE.cumsum(0)
    dst_lo = dst_hi - rows_RE
    local_R = _overlap(src_lo, src_hi, dst_lo, dst_hi).sum(1)
    first_R = torch.arange(R) // domain * domain
    last_R = torch.clamp(first_R + domain - 1, max=R - 1)
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


def pair_traffic(pairs_C2: torch.Tensor, num_ranks: int, domain: int) -> Traffic:
    """Per-rank counts of whole-object transfers ``(source, destination)`` (weight copies)."""
    src_C, dst_C = pairs_C2[:, 0], pairs_C2[:, 1]
    same_rank = src_C == dst_C
    same_dom = (src_C // domain) == (dst_C // domain)
    intra = same_dom & ~same_rank
    inter = ~same_dom

    def count(idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.bincount(idx[mask], minlength=num_ranks)

    return Traffic(
        local_R=count(src_C, same_rank),
        send_intra_R=count(src_C, intra),
        send_inter_R=count(src_C, inter),
        recv_intra_R=count(dst_C, intra),
        recv_inter_R=count(dst_C, inter),
    )
