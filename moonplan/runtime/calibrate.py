"""A :class:`~moonplan.stepcost.StepCost` from the runtime's own measured phase rates.

Legend: R ranks, E experts, r this rank, n samples (one per measured step), W rows per rank.

Every step records one :class:`StepSample` per rank (host numbers: rows and
distinct experts this rank ran, weights it fetched, rows it sent and received, and
the phase seconds of ``StepStats.phases``). :func:`fit_rates` turns a rank's
samples into rates:

* experts: ``experts_s ~ a * rows + b * groups`` (least squares over the samples when
  rows and groups both vary, independently enough, :data:`WELL_POSED`, and both come out
  non-negative; otherwise ``b = 0`` and ``a`` is seconds per row), mapped onto the
  roofline as ``row_flop_s = row_mem_s = a``, ``weight_read_s = b`` (the memory side
  ``b * groups + a * rows`` then always wins, which is the fitted line itself);
* copies: fetch seconds (measured where the fetch ran) per fetched expert, the least
  over the samples that fetched anything (a background fetch shares the cores with
  the dispatch and the home experts: the least contended step is the closest to the
  copy's own cost); else a local copy of one expert's weights, timed here (the
  shared-memory heap copies through the same memory);
* latency: the median ``counts`` all-gather (a collective carrying no rows);
* dispatch / combine: ``(phase - latency) / busiest rows`` (rows this rank sent or
  received, whichever is more), median over the samples;
* plan: median ``plan`` seconds per planner call (``balance="auto"``'s two paths are then
  timed on their own, ``moonplan.runtime.balancer.Balancer.calibrate``).

:func:`agree` takes the element-wise max of every rank's ``StepCost.as_tensor()``
over the group (collective), so every rank plans with the same model. Link
classes: on one host both classes get the same rates (``domain = 0``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from moonplan.comm.group import EPGroup
from moonplan.plan.plan_type import Plan
from moonplan.stepcost import StepCost


@dataclass(frozen=True)
class StepSample:
    """What one rank measured in one forward step (host numbers, seconds)."""

    rows: int  # rows this rank's experts ran (records, padding included)
    groups: int  # distinct experts with rows on this rank (weight reads)
    fetched: int  # expert weights fetched to this rank (new slots + direct reads)
    sent: int  # records this rank dispatched
    received: int  # records this rank received
    phases: dict[str, float]


def sample_step(
    plan: Plan,
    rank: int,
    sent: int,
    phases: dict[str, float],
    *,
    bounds_W1: Sequence[int],
    fetched: int,
) -> StepSample:
    """The :class:`StepSample` of this rank's step under ``plan`` (one host read: the
    records it received, ``plan.alloc[:, rank]``).

    ``bounds_W1`` (``plan.row_offset[rank]``, ``W + 1`` host integers) and ``fetched``
    (this rank's new slots plus direct rows, ``FetchList``) come from the plan's one
    read of the step (``moonplan.runtime.fetch_list.plan_rows``): its rows are the last
    offset, its groups the rows that take space (``align`` padding keeps a row with
    records non-empty and an empty row empty).
    """
    return StepSample(
        rows=bounds_W1[-1],
        groups=sum(b > a for a, b in pairwise(bounds_W1)),
        fetched=fetched,
        sent=sent,
        received=int(plan.alloc[:, rank].sum()),
        phases=dict(phases),
    )


def fit_rates(
    samples: list[StepSample], *, copy_fallback_s: float, align: int, overlap: bool
) -> StepCost:
    """This rank's :class:`StepCost` from its samples (see the module docstring).

    Args:
        samples: at least one.
        copy_fallback_s: seconds per expert copy when no sample fetched anything.
        align: receive-row padding (the model's ``tile_rows``).
        overlap: whether the runtime runs the overlapped schedule.
    """
    if not samples:
        raise ValueError("calibration needs at least one measured step")
    a, b = _fit_experts(samples)
    latency = statistics.median(s.phases.get("counts", 0.0) for s in samples)
    fetching = [s for s in samples if s.fetched > 0]
    copy_s = (
        min(s.phases.get("prefetch", 0.0) / s.fetched for s in fetching)
        if fetching
        else copy_fallback_s
    )
    dispatch = _per_row(samples, "dispatch", latency)
    combine = _per_row(samples, "combine", latency)
    plan_s = statistics.median(s.phases.get("plan", 0.0) for s in samples)
    return StepCost(
        row_flop_s=a,
        weight_read_s=b,
        row_mem_s=a,
        copy_s_intra=copy_s,
        copy_s_inter=copy_s,
        dispatch_row_s_intra=dispatch,
        dispatch_row_s_inter=dispatch,
        combine_row_s_intra=combine,
        combine_row_s_inter=combine,
        base_latency_s=latency,
        per_peer_latency_s=0.0,
        plan_s=plan_s,
        tile_rows=max(1, align),
        domain=0,
        overlap=overlap,
    )


WELL_POSED = 0.05
"""Relative spread (std / mean) that both rows and groups need over the samples, and
smallest over largest singular value of the mean-scaled ``[rows, groups]`` samples,
to fit both rates. Exact plans give every rank the same rows: then ``a * rows`` is
a constant, the fit of ``b`` would follow noise, and all of the time goes per row."""


def _fit_experts(samples: list[StepSample]) -> tuple[float, float]:
    """Non-negative ``(a, b)`` with ``experts_s ~ a * rows + b * groups``."""
    X = torch.tensor([[s.rows, s.groups] for s in samples], dtype=torch.float64)
    y = torch.tensor([s.phases.get("experts", 0.0) for s in samples], dtype=torch.float64)
    scale = X.mean(0).clamp(min=1e-12)
    spread = (X.std(0) / scale).min() if len(samples) >= 2 else torch.tensor(0.0)
    sv = torch.linalg.svdvals(X / scale)
    if float(spread) > WELL_POSED and float(sv[-1]) > WELL_POSED * float(sv[0]):
        a, b = (torch.linalg.lstsq(X / scale, y[:, None]).solution.flatten() / scale).tolist()
        if a >= 0 and b >= 0:
            return a, b
    rows = float(X[:, 0].sum())
    if rows > 0:  # one regressor: all of it per row
        return float(y.sum()) / rows, 0.0
    groups = float(X[:, 1].sum())
    return 0.0, (float(y.sum()) / groups if groups > 0 else 0.0)


def _per_row(samples: list[StepSample], phase: str, latency: float) -> float:
    rates = [
        max(0.0, s.phases.get(phase, 0.0) - latency) / max(s.sent, s.received)
        for s in samples
        if max(s.sent, s.received) > 0
    ]
    return statistics.median(rates) if rates else 0.0


def time_local_copy(weights: dict[str, torch.Tensor], repeats: int = 3) -> float:
    """Median seconds to copy one expert's weights (row 0 of every projection) locally."""
    rows = [w[:1] for w in weights.values() if w.shape[0] > 0]
    if not rows:
        return 0.0
    dst = [torch.empty_like(w) for w in rows]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for d, w in zip(dst, rows, strict=True):
            d.copy_(w)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def agree(group: EPGroup, cost: StepCost) -> StepCost:
    """Collective: the element-wise max of every rank's rates (one model everywhere)."""
    rates_RN = group.all_gather(cost.as_tensor()).cpu()
    return StepCost.from_tensor(
        rates_RN.max(0).values,
        tile_rows=cost.tile_rows,
        domain=cost.domain,
        overlap=cost.overlap,
    )
