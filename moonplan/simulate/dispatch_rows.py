"""Where each record of a policy step runs, and the step's dispatch rows under a scheme.

Legend:
    R ranks, E experts, S tokens per rank, K top-k, N = R*S*K records of the step
    ids_RSK   int64 expert of each record (token-major, as the router gives them)
    dest_RSK  int64 rank that executes each record; ``-1``: dropped (capacity)
    counts_RE int64 records source ``s`` routes to expert ``e`` (``token_counts(ids_RSK)``)
    keep_RE   int64 of those, records sent (the first ones in local order; the rest dropped)
    alloc_ER  int64 records of expert ``e`` rank ``r`` executes (``keep_RE.sum(0)`` per expert)

Every policy is routed by moonplan's rule (``moonplan/stepcost/traffic.py``): within an
expert, records ordered by source rank then local order, destination ranks taking
consecutive segments in ascending rank (:func:`line_dest`). moonplan's policies also use
the plan's affinity (``moonplan.route(..., affinity=True)``: a source's records of a split
expert go where their tokens already go), as the runtime does; the other policies keep
plain order (their own runtimes pick a replica per record without looking at the
token's other records). Static-shape padding (capacity) is sent as one row per padding
row under every scheme.
"""

from __future__ import annotations

import numpy as np
import torch

from moonplan.baselines.policy_base import PolicyStep
from moonplan.plan.plan_type import Plan
from moonplan.plan.route import route
from moonplan.simulate.token_routing import token_counts
from moonplan.stepcost.traffic import Traffic, add_traffic, dispatch_traffic, scheme_traffic

AFFINITY_POLICIES = ("moonplan", "moonplan-resident", "moonplan-auto")
"""Policies whose records are routed with the plan's affinity."""


def line_dest(
    ids_RSK: torch.Tensor,
    alloc_ER: torch.Tensor,
    keep_RE: torch.Tensor,
    counts_RE: torch.Tensor | None = None,
) -> np.ndarray:
    """int64 ``[R, S, K]`` executing rank of each record under the routing rule (module
    docstring); a source's records of ``e`` past the first ``keep_RE[s, e]`` are ``-1``;
    ``counts_RE``: ``token_counts(ids_RSK)`` if already counted."""
    R, S, K = ids_RSK.shape
    ids_N = ids_RSK.reshape(-1).numpy().astype(np.int64)
    alloc, keep = alloc_ER.numpy().astype(np.int64), keep_RE.numpy().astype(np.int64)
    E = alloc.shape[0]
    narrow = np.int16 if E <= np.iinfo(np.int16).max else np.int32  # radix sort: faster
    order_N = np.argsort(ids_N.astype(narrow), kind="stable")  # by (expert, source, local)
    e_N, s_N = ids_N[order_N], order_N // max(1, S * K)
    if counts_RE is None:
        counts = np.bincount(s_N * E + e_N, minlength=R * E).reshape(R, E)
    else:
        counts = counts_RE.numpy().astype(np.int64)
    first_E = np.cumsum(counts.sum(0)) - counts.sum(0)
    j_N = np.arange(ids_N.size) - first_E[e_N] - (np.cumsum(counts, 0) - counts)[s_N, e_N]
    sent_N = j_N < keep[s_N, e_N]
    kept_first_E = np.cumsum(keep.sum(0)) - keep.sum(0)
    line_N = kept_first_E[e_N] + (np.cumsum(keep, 0) - keep)[s_N, e_N] + j_N
    cell_N = np.searchsorted(np.cumsum(alloc.reshape(-1)), line_N, side="right")
    dest_N = np.full(ids_N.size, -1, dtype=np.int64)
    dest_N[order_N[sent_N]] = cell_N[sent_N] % R
    return dest_N.reshape(R, S, K)


def affinity_dest(
    ids_RSK: torch.Tensor, alloc_ER: torch.Tensor, counts_RE: torch.Tensor | None = None
) -> np.ndarray:
    """int64 ``[R, S, K]`` executing rank of each record under ``route(..., affinity=True)``
    of a plan that executes ``alloc_ER`` (dropless: every record is sent); ``counts_RE``:
    ``token_counts(ids_RSK)`` if already counted."""
    R, _, _ = ids_RSK.shape
    E = alloc_ER.shape[0]
    counts_RE = token_counts(ids_RSK, E) if counts_RE is None else counts_RE
    plan = Plan.from_alloc(counts_RE, alloc_ER, slots=E)
    return np.stack(
        [route(plan, s, ids_RSK[s], check=False, affinity=True).dest_rank.numpy() for s in range(R)]
    ).astype(np.int64)


def step_dest(
    step: PolicyStep, ids_RSK: torch.Tensor, affinity: bool, counts_RE: torch.Tensor | None = None
) -> np.ndarray:
    """int64 ``[R, S, K]`` executing rank of each record of ``step`` (``-1``: dropped);
    ``affinity`` routes with the plan's affinity (dropless steps only); ``counts_RE``:
    ``token_counts(ids_RSK)`` if already counted."""
    if counts_RE is None:
        counts_RE = token_counts(ids_RSK, step.alloc_ER.shape[0])
    keep_RE = torch.minimum(counts_RE, step.sent_RE)
    if affinity and torch.equal(keep_RE, counts_RE):
        return affinity_dest(ids_RSK, step.alloc_ER, counts_RE)
    return line_dest(ids_RSK, step.alloc_ER, keep_RE, counts_RE)


def step_traffic(
    step: PolicyStep,
    ids_RSK: torch.Tensor,
    scheme: str,
    domain: int,
    dest_RSK: np.ndarray,
    counts_RE: torch.Tensor | None = None,
) -> Traffic:
    """Dispatch rows of ``step`` by link under ``scheme``: the records' rows
    (``scheme_traffic`` of ``dest_RSK``, from :func:`step_dest`) plus any padding rows;
    ``counts_RE``: ``token_counts(ids_RSK)`` if already counted."""
    if counts_RE is None:
        counts_RE = token_counts(ids_RSK, step.alloc_ER.shape[0])
    pad_RE = step.sent_RE - torch.minimum(counts_RE, step.sent_RE)
    rows = scheme_traffic(dest_RSK, scheme, domain)
    if not bool(pad_RE.any()):
        return rows
    return add_traffic(rows, dispatch_traffic(pad_RE, step.rows_ER - step.alloc_ER, domain))


def scheme_step_traffic(
    step: PolicyStep,
    ids_RSK: torch.Tensor | None,
    scheme: str,
    domain: int,
    counts_RE: torch.Tensor | None = None,
) -> Traffic:
    """:func:`step_traffic` with the records routed by :func:`step_dest` (affinity for
    :data:`AFFINITY_POLICIES`); ``ids_RSK`` is required (loud error without it). The
    tokens are counted at most once for the routing and the padding (``counts_RE``:
    ``token_counts(ids_RSK)`` if already counted, e.g. the counts the step planned on)."""
    if ids_RSK is None:
        raise ValueError(f"dispatch={scheme!r} needs the step's token routing (topk_ids)")
    if counts_RE is None:
        counts_RE = token_counts(ids_RSK, step.alloc_ER.shape[0])
    dest_RSK = step_dest(step, ids_RSK, step.name in AFFINITY_POLICIES, counts_RE)
    return step_traffic(step, ids_RSK, scheme, domain, dest_RSK, counts_RE)
