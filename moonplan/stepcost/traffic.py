"""Who sends how many dispatch rows to whom: per-rank volumes split by link.

Legend:
    R ranks    E experts    G ranks per NVLink domain (consecutive ranks share one)
    S tokens per rank    K top-k    U unique rows of a scheme
    sent_RE  int64 rows source ``s`` sends towards expert ``e``
    rows_ER  int64 rows rank ``r`` computes for expert ``e`` (``sent_RE.sum(0) == rows_ER.sum(1)``)
    dest_RSK int64 rank that executes each record (token ``t`` of source ``s``, its ``k``-th
             expert); ``-1``: not sent (dropped)

Routing rule (moonplan's; ``moonplan/plan/README.md``, "Per-record routing"): within
expert ``e`` the rows are ordered by source rank, and destination ranks take
consecutive segments of that order in ascending rank. Source ``s`` owns ``[lo, hi)``
of that order, destination ``r`` owns another interval; what ``s`` sends to ``r`` is
their overlap. Because a
domain's ranks are consecutive, a whole domain also owns one interval, so the
rows that stay on a rank, stay inside its domain or cross the network are all
interval overlaps: ``O(R*E)`` work, no ``R x R`` matrix. Every policy is routed by
this rule (EPLB splits an expert over its replicas the same way).

Counts do not say which records of one token share a destination, so
:func:`dispatch_traffic` moves every record as its own ``H``-vector (the ``"record"``
dispatch scheme). With each record's destination known (``dest_RSK``),
:func:`scheme_traffic` counts the rows of the other schemes (``docs/simulator.md``):

* ``"rank"``: one row per ``(token, destination rank)``;
* ``"host"``: two-stage. Inside the source's domain, one row per ``(token, destination
  rank)`` as in ``"rank"``; towards another domain ``h``, one row per ``(token, h)``
  over the network to the rank of ``h`` with the source's local index (its NIC peer),
  which forwards it over the fast links to each other rank of ``h`` the token needs.

Combine is the reverse of dispatch under each scheme (an executing rank sums a
token's records before sending one row back; under ``"host"`` the NIC peer sums its
domain's rows first), so it uses the same rows with send and receive swapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moonplan.host_arrays import host_int64

SCHEMES = ("record", "rank", "host")
"""Dispatch schemes: a row per record, per (token, destination rank), per (token, host)."""


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


def dispatch_traffic(sent_RE: Any, rows_ER: Any, domain: int) -> Traffic:
    """Per-rank rows kept local, sent/received inside the NVLink domain and across it.

    Args:
        sent_RE: int64 ``[R, E]`` (torch or numpy).
        rows_ER: int64 ``[E, R]`` with the same per-expert totals.
        domain: ``G >= 1`` ranks per NVLink domain (ranks ``[kG, (k+1)G)`` share one).

    Each rank's interval ends are one cumulative sum per side, whose last column holds
    the expert totals checked here; ``moonplan.stepcost.reference`` has the same
    quantities one overlap at a time.
    """
    sent_RE, rows_ER = host_int64(sent_RE), host_int64(rows_ER)
    R, E = sent_RE.shape
    if rows_ER.shape != (E, R):
        raise ValueError("sent_RE and rows_ER must be [R, E] and [E, R] with equal expert totals")
    # [E, R] layout throughout: numpy's running sums along a contiguous axis are several
    # times faster than down the ranks of sent_RE (a strided axis)
    sent_ER = np.ascontiguousarray(sent_RE.T)
    src_hi = sent_ER.cumsum(1)
    dst_hi = rows_ER.cumsum(1)
    if R and (src_hi[:, -1] != dst_hi[:, -1]).any():
        raise ValueError("sent_RE and rows_ER must be [R, E] and [E, R] with equal expert totals")
    src_lo = src_hi - sent_ER
    dst_lo = dst_hi - rows_ER
    send_R, recv_R = sent_ER.sum(0), rows_ER.sum(0)
    local_R = _overlap_sum(src_lo, src_hi, dst_lo, dst_hi)
    if domain >= R:  # one domain: everything not local is intra-domain
        send_dom, recv_dom = send_R, recv_R
    elif R % domain == 0:  # whole domains: each one's interval broadcast over its ranks
        n, G = R // domain, domain
        per_dom = (src_lo, src_hi, dst_lo, dst_hi)
        s_lo, s_hi, d_lo, d_hi = (a.reshape(E, n, G) for a in per_dom)
        send_dom = _overlap_sum(s_lo, s_hi, d_lo[:, :, :1], d_hi[:, :, -1:]).reshape(R)
        recv_dom = _overlap_sum(d_lo, d_hi, s_lo[:, :, :1], s_hi[:, :, -1:]).reshape(R)
    else:
        first_R = np.arange(R) // domain * domain
        last_R = np.minimum(first_R + domain - 1, R - 1)
        send_dom = _overlap_sum(src_lo, src_hi, dst_lo[:, first_R], dst_hi[:, last_R])
        recv_dom = _overlap_sum(dst_lo, dst_hi, src_lo[:, first_R], src_hi[:, last_R])
    return Traffic(
        local_R=local_R,
        send_intra_R=send_dom - local_R,
        send_inter_R=send_R - send_dom,
        recv_intra_R=recv_dom - local_R,
        recv_inter_R=recv_R - recv_dom,
    )


def _overlap_sum(
    a_lo: np.ndarray, a_hi: np.ndarray, b_lo: np.ndarray, b_hi: np.ndarray
) -> np.ndarray:
    """Summed over the experts (axis 0), the lengths of the overlaps of intervals
    ``[a_lo, a_hi)`` and ``[b_lo, b_hi)`` (int64 ``[E, ...]`` each, or broadcast)."""
    gap = np.minimum(a_hi, b_hi)
    gap -= np.maximum(a_lo, b_lo)
    return np.maximum(gap, 0, out=gap).sum(0)


def pair_traffic(pairs_C2: Any, num_ranks: int, domain: int) -> Traffic:
    """Per-rank counts of whole-object transfers ``(source, destination)`` (weight copies).

    One count per end: each transfer is keyed ``rank * 3 + class`` (0 local, 1 inside
    the domain, 2 across), so a single ``bincount`` of ``3 R`` bins holds every field.
    """
    pairs_C2 = host_int64(pairs_C2).reshape(-1, 2)
    src_C, dst_C = pairs_C2[:, 0], pairs_C2[:, 1]
    class_C = np.where((src_C // domain) == (dst_C // domain), (src_C != dst_C) * 1, 2)
    send_R3 = np.bincount(src_C * 3 + class_C, minlength=3 * num_ranks).reshape(-1, 3)
    recv_R3 = np.bincount(dst_C * 3 + class_C, minlength=3 * num_ranks).reshape(-1, 3)
    return Traffic(
        local_R=send_R3[:, 0],
        send_intra_R=send_R3[:, 1],
        send_inter_R=send_R3[:, 2],
        recv_intra_R=recv_R3[:, 1],
        recv_inter_R=recv_R3[:, 2],
    )


def add_traffic(first: Traffic, *rest: Traffic) -> Traffic:
    """Field-wise sum of several :class:`Traffic` of the same ranks."""
    out = first
    for t in rest:
        out = Traffic(
            out.local_R + t.local_R,
            out.send_intra_R + t.send_intra_R,
            out.send_inter_R + t.send_inter_R,
            out.recv_intra_R + t.recv_intra_R,
            out.recv_inter_R + t.recv_inter_R,
        )
    return out


def scheme_traffic(dest_RSK: Any, scheme: str, domain: int) -> Traffic:
    """Per-rank rows of one dispatch under ``scheme`` (module docstring), by link.

    Args:
        dest_RSK: int64 ``[R, S, K]`` executing rank of each record, ``-1``: not sent.
        scheme: one of :data:`SCHEMES`.
        domain: ``G >= 1`` ranks per NVLink domain (ranks ``[kG, (k+1)G)`` share one).
    """
    dest = host_int64(dest_RSK)
    if dest.ndim != 3 or scheme not in SCHEMES or domain < 1:
        raise ValueError(f"need dest_RSK [R, S, K], scheme in {SCHEMES}, domain >= 1")
    R = dest.shape[0]

    def pairs(src_N: np.ndarray, dst_N: np.ndarray) -> Traffic:
        return pair_traffic(np.stack([src_N, dst_N], 1), R, domain)

    if scheme == "record":
        return pairs(*_rows(dest))
    src_U, dst_U = _rows(_first_per_token(dest))
    if scheme == "rank":
        return pairs(src_U, dst_U)
    far_U = dst_U // domain != src_U // domain
    src_H, host_H = _rows(_first_per_token(np.where(dest < 0, -1, dest // domain)))
    far_H = host_H != src_H // domain
    src_H, host_H = src_H[far_H], host_H[far_H]
    return add_traffic(
        pairs(src_U[~far_U], dst_U[~far_U]),  # inside the source's domain
        pairs(src_H, _nic_peer(src_H, host_H, R, domain)),  # over the network
        pairs(_nic_peer(src_U[far_U], dst_U[far_U] // domain, R, domain), dst_U[far_U]),
    )


def rows_per_record(dest_RSK: Any, scheme: str, domain: int) -> float:
    """Rows sent per record under ``scheme`` (``"host"``: rows over the network and inside
    the source's domain, forwarded copies not counted); 0 with no record."""
    dest = host_int64(dest_RSK)
    records = int((dest >= 0).sum())
    if scheme == "host":
        home_R11 = np.arange(dest.shape[0])[:, None, None] // domain
        near = np.where(dest // domain == home_R11, dest, -1)
        far = np.where((dest >= 0) & (near < 0), dest // domain, -1)
        rows = int((_first_per_token(near) >= 0).sum() + (_first_per_token(far) >= 0).sum())
    else:
        rows = int((_first_per_token(dest) >= 0).sum()) if scheme == "rank" else records
    return rows / records if records else 0.0


def _first_per_token(key_RSK: np.ndarray) -> np.ndarray:
    """``key_RSK`` where an entry is its token's first occurrence of that key, else ``-1``
    (``K(K-1)/2`` vectorised comparisons: cheaper than sorting each token's ``K`` keys)."""
    first = key_RSK.copy()
    for k in range(1, key_RSK.shape[2]):
        seen = (key_RSK[..., :k] == key_RSK[..., k : k + 1]).any(axis=2)
        first[..., k][seen] = -1
    return first


def _rows(key_RSK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(source, key)`` of every entry of ``key_RSK`` that is ``>= 0``."""
    s_N, t_N, k_N = np.nonzero(key_RSK >= 0)
    return s_N, key_RSK[s_N, t_N, k_N]


def _nic_peer(src_N: np.ndarray, host_N: np.ndarray, num_ranks: int, domain: int) -> np.ndarray:
    """Rank of domain ``host_N`` with the source's local index (modulo a short last domain)."""
    size_N = np.minimum(domain, num_ranks - host_N * domain)
    return host_N * domain + (src_N % domain) % size_N
