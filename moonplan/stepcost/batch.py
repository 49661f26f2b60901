"""``StepCost``'s step time for many allocations at once, in torch ops on any device.

Legend:
    C candidates (allocations scored together)    R ranks    E experts
    G ranks per fast-link domain (consecutive ranks share one)
    counts_RE  int64 records source ``s`` routes to expert ``e`` (the same for every candidate)
    alloc_CER  int64 records of expert ``e`` each candidate runs on rank ``r``
    fetch_CER  bool  ``(e, r)`` whose weights arrive this step (replicas not resident)
    home_E     int64 rank each expert's weights are fetched from

The planner's ``policy="auto"`` scores its candidates with this (``moonplan.plan.choice``):
no value is read on the host, shapes depend only on ``(C, R, E)``, so it runs inside a
CUDA graph. It is :meth:`StepCost.step_time` (the ``"record"`` dispatch scheme) with the
same floating-point operations in the same order: every float is a rate (a Python float)
times an integer-valued float64, a ``max``, or a sum in the order the docstring of
:mod:`moonplan.stepcost.step_cost` writes it, so the results are equal bit for bit
(``tests/stepcost/test_batch.py``). Integer quantities (rows, copies, overlaps) are
summed in int64, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moonplan.stepcost.step_cost import StepCost


@dataclass(frozen=True)
class BatchTime:
    """Seconds per phase of each candidate's step (float64 ``[C]`` each, on the inputs'
    device): :class:`~moonplan.stepcost.StepTime` field by field. Where the planning
    charged is ``[..., C]`` (several charges per candidate), so are ``plan_s``,
    ``prefetch_exposed_s`` and ``total_s``."""

    plan_s: torch.Tensor
    prefetch_s: torch.Tensor
    prefetch_exposed_s: torch.Tensor
    dispatch_s: torch.Tensor
    experts_s: torch.Tensor
    combine_s: torch.Tensor
    total_s: torch.Tensor


def batch_step_time(
    cost: StepCost,
    counts_RE: torch.Tensor,
    alloc_CER: torch.Tensor,
    fetch_CER: torch.Tensor | None,
    home_E: torch.Tensor,
    plan_C: torch.Tensor,
) -> BatchTime:
    """Predicted phases of ``C`` steps that differ only in their allocation and fetches.

    Args:
        cost: the model (its rates are read as Python floats).
        counts_RE: int64 ``[R, E]``.
        alloc_CER: int64 ``[C, E, R]`` with ``alloc[c].sum(1) == counts.sum(0)``.
        fetch_CER: bool ``[C, E, R]``, or ``None``: nothing fetched (the same floats as
            all false, without the copies' and fetched sections' work).
        home_E: int64 ``[E]``.
        plan_C: float64 ``[C]`` planning seconds charged to each candidate, or ``[P, C]``:
            ``P`` charges each, scored from one set of phases.

    Returns:
        :class:`BatchTime`, equal bit for bit to ``cost.step_time(alloc[c], counts,
        fetch[c], home_E)`` with ``plan_s * planned == plan_C[c]`` (``plan_C[p, c]``:
        the totals are ``[P, C]``).
    """
    _C, _E, R = alloc_CER.shape
    G = cost.domain_size(R)
    d_intra, d_inter = _busiest(*_dispatch_traffic(counts_RE, alloc_CER, G))
    D, Cb = _all_to_all(cost, R, d_intra, d_inter)
    if fetch_CER is None:
        return _schedule(cost, plan_C, (D, Cb), *_unfetched(cost, alloc_CER))
    moves = _copy_traffic(fetch_CER, home_E, G)
    beside_CR = moves[0] + moves[1] + moves[2] + moves[3] if cost.overlap else None
    home_R, wait_R = _sections(cost, alloc_CER, fetch_CER, beside_CR)
    w_intra, w_inter = _busiest(*moves)
    alone, ready = _fetch(cost, (w_intra, w_inter), (d_intra, d_inter))
    return _schedule(cost, plan_C, (D, Cb), (home_R, wait_R), (alone, ready))


def _overlap_sum(
    a_lo: torch.Tensor, a_hi: torch.Tensor, b_lo: torch.Tensor, b_hi: torch.Tensor, dim: int
) -> torch.Tensor:
    """Summed over ``dim``, the lengths of the overlaps of ``[a_lo, a_hi)`` and ``[b_lo, b_hi)``."""
    return (torch.minimum(a_hi, b_hi) - torch.maximum(a_lo, b_lo)).clamp(min=0).sum(dim)


def _dispatch_traffic(
    counts_RE: torch.Tensor, alloc_CER: torch.Tensor, G: int
) -> tuple[torch.Tensor, ...]:
    """Per candidate and rank (int64 ``[C, R]``): rows sent inside the domain, sent
    across, received inside, received across (``traffic.dispatch_traffic``'s rule)."""
    R = counts_RE.shape[0]
    sent_ER = counts_RE.t()
    src_hi = sent_ER.cumsum(1)[None]  # [1, E, R]
    src_lo = src_hi - sent_ER[None]
    dst_hi = alloc_CER.cumsum(2)
    dst_lo = dst_hi - alloc_CER
    send_R = counts_RE.sum(1)[None]
    recv_CR = alloc_CER.sum(1)
    local_CR = _overlap_sum(src_lo, src_hi, dst_lo, dst_hi, 1)
    if G >= R:  # one domain: everything not local is intra-domain
        send_dom, recv_dom = send_R.expand_as(local_CR), recv_CR
    else:
        first_R = torch.arange(R, device=counts_RE.device) // G * G
        last_R = (first_R + (G - 1)).clamp(max=R - 1)
        d_lo, d_hi = dst_lo[:, :, first_R], dst_hi[:, :, last_R]
        s_lo, s_hi = src_lo[:, :, first_R], src_hi[:, :, last_R]
        send_dom = _overlap_sum(src_lo, src_hi, d_lo, d_hi, 1)
        recv_dom = _overlap_sum(dst_lo, dst_hi, s_lo, s_hi, 1)
    return send_dom - local_CR, send_R - send_dom, recv_dom - local_CR, recv_CR - recv_dom


def _copy_traffic(
    fetch_CER: torch.Tensor, home_E: torch.Tensor, G: int
) -> tuple[torch.Tensor, ...]:
    """Weight copies per candidate and rank (int64 ``[C, R]``), from each expert's home
    to the fetching rank: sent inside the domain, across, received inside, across."""
    C, _E, R = fetch_CER.shape
    r_R = torch.arange(R, device=fetch_CER.device)
    near_ER = (home_E[:, None] // G) == (r_R[None, :] // G)
    far_CER = fetch_CER & ~near_ER
    near_CER = fetch_CER & near_ER & (home_E[:, None] != r_R[None, :])  # a copy home: none
    zeros = torch.zeros(C, R, dtype=torch.int64, device=fetch_CER.device)
    send_near = zeros.index_add(1, home_E, near_CER.sum(2))
    send_far = zeros.index_add(1, home_E, far_CER.sum(2))
    return send_near, send_far, near_CER.sum(1), far_CER.sum(1)


def _busiest(
    send_in: torch.Tensor, send_out: torch.Tensor, recv_in: torch.Tensor, recv_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rank, the busier direction of each link class, as float64 ``[C, R]``."""
    intra = torch.maximum(send_in, recv_in).to(torch.float64)
    return intra, torch.maximum(send_out, recv_out).to(torch.float64)


def _all_to_all(
    cost: StepCost, R: int, intra: torch.Tensor, inter: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch and combine seconds ``[C]`` (``StepCost._dispatch_combine``)."""
    if R <= 1:
        zero = intra.new_zeros(intra.shape[0])
        return zero, zero
    lat = cost.base_latency_s + cost.per_peer_latency_s * (R - 1)
    D = torch.maximum(intra * cost.dispatch_row_s_intra, inter * cost.dispatch_row_s_inter)
    Cb = torch.maximum(intra * cost.combine_row_s_intra, inter * cost.combine_row_s_inter)
    return lat + D.amax(1), lat + Cb.amax(1)


def _padded(cost: StepCost, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (int64, ``>= 0``) each padded up to a multiple of ``tile_rows``."""
    t = cost.tile_rows
    return rows if t == 1 else (rows + (t - 1)) // t * t


def _roofline(
    cost: StepCost,
    padded_CR: torch.Tensor,
    experts_CR: torch.Tensor,
    rows_CR: torch.Tensor,
    copies_CR: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 ``[C, R]``: ``StepCost._roofline`` of those integer sums (``copies_CR``: the
    weight copies each rank sends or receives beside these rows)."""
    flop = padded_CR.to(torch.float64) * cost.row_flop_s
    mem = experts_CR.to(torch.float64) * cost.weight_read_s
    mem = mem + rows_CR.to(torch.float64) * cost.row_mem_s
    if copies_CR is not None:
        mem = mem + copies_CR.to(torch.float64) * cost.weight_read_s
    return torch.maximum(flop, mem)


def _sections(
    cost: StepCost,
    alloc_CER: torch.Tensor,
    fetch_CER: torch.Tensor,
    beside_CR: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's home section (rows whose weights are ready; ``beside_CR``: the copies
    running beside it) and fetched section."""
    wait_CER = torch.where(fetch_CER, alloc_CER, 0)
    padded_CER = _padded(cost, alloc_CER)
    all_3 = (padded_CER.sum(1), (alloc_CER > 0).sum(1), alloc_CER.sum(1))
    wait_3 = (_padded(cost, wait_CER).sum(1), (wait_CER > 0).sum(1), wait_CER.sum(1))
    padded, busy, rows = (a - w for a, w in zip(all_3, wait_3, strict=True))
    return _roofline(cost, padded, busy, rows, beside_CR), _roofline(cost, *wait_3)


def _unfetched(
    cost: StepCost, alloc_CER: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(sections, fetch)`` of :func:`_schedule` where nothing is fetched: every row in its
    home section, an empty fetched section (0.0 seconds, as :func:`_roofline` of zeros
    gives), no copy (0 and 0, as :func:`_fetch` gives)."""
    all_3 = (_padded(cost, alloc_CER).sum(1), (alloc_CER > 0).sum(1), alloc_CER.sum(1))
    home_CR = _roofline(cost, *all_3)
    zero_C = home_CR.new_zeros(home_CR.shape[0])
    return (home_CR, torch.zeros_like(home_CR)), (zero_C, zero_C)


def _fetch(
    cost: StepCost,
    weights: tuple[torch.Tensor, torch.Tensor],
    data: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(alone, ready)`` seconds ``[C]`` of the copies (``StepCost._fetch``; 0 and 0 for
    a candidate that copies nothing)."""
    w_in, w_out = weights
    d_in, d_out = data
    alone = torch.maximum(w_in * cost.copy_s_intra, w_out * cost.copy_s_inter).amax(1)
    intra = d_in * cost.dispatch_row_s_intra + w_in * cost.copy_s_intra
    inter = d_out * cost.dispatch_row_s_inter + w_out * cost.copy_s_inter
    shared = torch.maximum(alone, torch.maximum(intra, inter).amax(1))
    copies = ((w_in > 0) | (w_out > 0)).any(1)
    zero = torch.zeros_like(alone)
    alone_s = torch.where(copies, alone + cost.base_latency_s, zero)
    return alone_s, torch.where(copies, shared + cost.base_latency_s, zero)


def _schedule(
    cost: StepCost,
    plan: torch.Tensor,
    link: tuple[torch.Tensor, torch.Tensor],
    sections: tuple[torch.Tensor, torch.Tensor],
    fetch: tuple[torch.Tensor, torch.Tensor],
) -> BatchTime:
    """The phases from their parts (``StepCost._schedule``)."""
    D, Cb = link
    home, wait = sections
    alone, ready = fetch
    experts = (home + wait).amax(1)
    without = plan + D + experts + Cb
    if cost.overlap:
        total = plan + (torch.maximum(D[:, None] + home, ready[:, None]) + wait).amax(1) + Cb
    else:
        total = without + alone
    exposed = (total - without).clamp(min=0.0)
    return BatchTime(plan, alone, exposed, D, experts, Cb, total)
