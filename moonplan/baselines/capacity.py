"""Switch/GShard-style expert capacity: fixed-size expert buffers, overflow records dropped.

Legend: R ranks, E experts; ``counts_RE`` int64 ``[R, E]``; ``cap_R`` int64 ``[R]``
capacity of one expert's buffer from one source rank (rows).

Description followed (Switch Transformer §2.2, GShard §2): every expert gets a
buffer of ``capacity = tokens / E * capacity_factor`` rows; records beyond it are
*dropped* (they skip the expert and ride the residual connection), and the
buffers have a static shape, so the expert computes and the all-to-all carries
the whole buffer, full or not. The capacity is computed per *group*, here the
tokens of one source rank: source ``s`` with ``n_s = sum_e counts[s, e]`` records
has ``cap_s = ceil(factor * n_s / E)`` rows for each expert (``ceil`` so that a
factor of 1 never drops perfectly balanced input). Placement is static (linear).
moonplan never drops a record; this baseline shows what dropping costs in
records and what padding costs in rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from moonplan.baselines.policy_base import Policy, PolicyStep
from moonplan.baselines.registry import PolicyInfo, register
from moonplan.plan.placement import static_alloc
from moonplan.plan.validate import as_counts


def capacity_per_source(counts: Any, factor: float) -> torch.Tensor:
    """``cap_R``: rows per expert buffer from each source, ``ceil(factor * n_s / E)`` (int64)."""
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise ValueError(f"capacity factor must be a positive number, got {factor!r}")
    counts_RE = as_counts(counts).cpu()
    E = counts_RE.shape[1]
    n_R = counts_RE.sum(1).tolist()
    # Exact rational arithmetic: 1.25 * 80 / 100 must give 1, not 1.0000000000000002 -> 2.
    num, den = float(factor).as_integer_ratio()
    return torch.tensor([-(-(num * n) // (den * E)) for n in n_R], dtype=torch.int64)


def capacity_kept(counts: Any, factor: float) -> torch.Tensor:
    """``[R, E]`` records kept (executed): ``min(counts[s, e], cap_s)``."""
    counts_RE = as_counts(counts).cpu()
    return torch.minimum(counts_RE, capacity_per_source(counts_RE, factor)[:, None])


class CapacityPolicy(Policy):
    """Static linear placement with per-source expert capacity ``factor`` (see module doc).

    ``pad=True`` (Switch/GShard static shapes): every source sends, and every expert
    computes, ``cap_s`` rows per (source, expert) whatever the real count.
    ``pad=False``: only the kept records move and are computed (drop without padding).
    """

    def __init__(
        self, num_ranks: int, num_experts: int, *, factor: float = 1.0, pad: bool = True
    ) -> None:
        super().__init__(num_ranks, num_experts)
        capacity_per_source(torch.zeros(1, 1, dtype=torch.int64), factor)  # validate
        self.factor = float(factor)
        self.pad = pad
        self.name = f"capacity-{self.factor!r}"

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        kept_RE = capacity_kept(counts_RE, self.factor)
        if self.pad:
            cap_R = capacity_per_source(counts_RE, self.factor)
            sent_RE = cap_R[:, None].expand(-1, self.num_experts).clone()
        else:
            sent_RE = kept_RE
        return PolicyStep(
            name=self.name,
            alloc_ER=static_alloc(kept_RE),
            rows_ER=static_alloc(sent_RE),
            sent_RE=sent_RE,
            dropped=int((counts_RE - kept_RE).sum()),
        )


def capacity_policy(name: str, num_ranks: int, num_experts: int) -> CapacityPolicy:
    """``capacity-<f>``: :class:`CapacityPolicy` with factor ``f``, named as asked
    (``"capacity-2"`` stays ``"capacity-2"``)."""
    try:
        factor = float(name.removeprefix("capacity-"))
    except ValueError:
        raise ValueError(f"bad capacity policy {name!r}; use e.g. capacity-1.25") from None
    if not factor > 0:
        raise ValueError(f"capacity factor must be > 0, got {factor}")
    policy = CapacityPolicy(num_ranks, num_experts, factor=factor)
    policy.name = name
    return policy


register(PolicyInfo("capacity-1.0", capacity_policy, label="cap1.0", order=20))
register(PolicyInfo("capacity-1.25", capacity_policy, label="cap1.25", order=30))
register(PolicyInfo("capacity-", capacity_policy, listed=False, family=True))
