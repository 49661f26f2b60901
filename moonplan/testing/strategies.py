"""Hypothesis strategies for planner inputs: router counts ``[R, E]`` and plan options.

Public API for anyone who property-tests a balancing policy (``docs/api.md``,
``docs/planner-policy.md``)::

    from hypothesis import given, strategies as st
    from moonplan.testing import counts, plan_options

    @given(st.data())
    def test_my_policy(data):
        counts_RE = data.draw(counts())
        opts = data.draw(plan_options(*counts_RE.shape))
        ...

Legend:
    R ranks    E experts    N total records ``counts_RE.sum()``
    M = ceil(E/R)    target ``N // R`` (+1 on the first ``N mod R`` ranks)
    records_R  records each source rank routes (a row sum of counts_RE)
    w_E        relative popularity of each expert (floats)

Every value is drawn from small integers and floats, so hypothesis shrinks a
failure to a tiny readable case (few ranks, few experts, few records). The
strategies cover: any ``R >= 1`` and ``E >= 1`` (``E < R``, ``E mod R != 0``),
``N mod R != 0``, ``N = 0``, ranks without tokens, one hot expert holding more
records than a rank's target, uniform, lognormal, Zipf and arbitrary counts.

Needs ``hypothesis`` (the ``test`` extra); ``import moonplan`` does not.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from moonplan.plan.home import max_local

try:
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - exercised only without the test extra
    raise ImportError(
        "moonplan.testing.strategies needs hypothesis: pip install 'moonplan[test]'"
    ) from exc

COUNTS_FAMILIES = ("uniform", "lognormal", "zipf", "hot", "zero", "random")
"""Shapes of the counts drawn by :func:`counts`.

``uniform``/``lognormal``/``zipf``/``hot``: every source rank splits its records
over the experts in proportion to one popularity ``w_E`` (largest remainder);
``hot``: one expert gets 50-95 % of the popularity; ``zero``: all counts 0;
``random``: every entry drawn independently.
"""

ALIGNS = (1, 2, 4, 8, 128)
"""Row paddings drawn by :func:`plan_options`."""


def counts(
    *,
    min_ranks: int = 1,
    max_ranks: int = 8,
    min_experts: int = 1,
    max_experts: int = 24,
    max_records_per_rank: int = 48,
    families: tuple[str, ...] | list[str] = COUNTS_FAMILIES,
    sigma: float | None = None,
    empty_ranks: bool = True,
) -> st.SearchStrategy[torch.Tensor]:
    """Strategy for router counts: int64 tensors ``[R, E]`` (CPU), non-negative.

    Args:
        min_ranks, max_ranks: bounds on ``R`` (``1 <= min_ranks <= max_ranks``).
        min_experts, max_experts: bounds on ``E`` (``1 <= min_experts <= max_experts``).
        max_records_per_rank: most records one source rank routes (``>= 0``);
            ``random`` rows may exceed it by up to a factor 2.
        families: subset of :data:`COUNTS_FAMILIES` to draw from.
        sigma: std of the log-popularity of ``lognormal``; ``None`` draws it in ``[0, 3]``.
        empty_ranks: whether some source ranks may route no records at all.

    Returns:
        A hypothesis strategy of int64 ``[R, E]`` tensors.
    """
    _check_bounds("ranks", min_ranks, max_ranks, least=1)
    _check_bounds("experts", min_experts, max_experts, least=1)
    _check_bounds("records per rank", 0, max_records_per_rank, least=0)
    unknown = set(families) - set(COUNTS_FAMILIES)
    if not families or unknown:
        raise ValueError(
            f"families must be a non-empty subset of {COUNTS_FAMILIES}, got {families}"
        )
    if sigma is not None and not 0 <= sigma <= 10:
        raise ValueError(f"sigma must be in [0, 10] or None, got {sigma}")
    return _counts(
        (min_ranks, max_ranks),
        (min_experts, max_experts),
        max_records_per_rank,
        tuple(families),
        sigma,
        empty_ranks,
    )


def plan_options(num_ranks: int, num_experts: int) -> st.SearchStrategy[dict[str, Any]]:
    """Strategy for ``moonplan.plan`` keyword options on counts of shape ``[R, E]``.

    Returns:
        Dicts ``{"slots": None or 0..min(M+2, E), "align": one of ALIGNS}`` with
        ``M = ceil(E/R)``: default slots, fewer than ``M`` (direct replicas),
        exactly ``M`` and more than ``M`` (never more than ``E``, the planner's limit).
    """
    _check_bounds("num_ranks", 1, num_ranks, least=1)
    _check_bounds("num_experts", 1, num_experts, least=1)
    M = max_local(num_experts, num_ranks)
    return st.fixed_dictionaries(
        {
            "slots": st.none() | st.integers(0, min(M + 2, num_experts)),
            "align": st.sampled_from(ALIGNS),
        }
    )


@st.composite
def allocs(draw: st.DrawFn, counts_RE: torch.Tensor, *, slots: int | None = None) -> torch.Tensor:
    """Strategy for an allocation ``alloc_ER`` int64 ``[E, R]`` that ``Plan.from_alloc`` accepts.

    Every expert's records ``counts_RE[:, e].sum()`` are split over the ranks at
    random (home only, a few ranks, or all), keeping at most ``K = max(slots, M)``
    remote experts per rank (``slots=None``: ``M``). Loads are whatever the split
    gives: use it for the policy-agnostic checks (``check_plan(strict=False)``).
    """
    R, E = counts_RE.shape
    M = max_local(E, R)
    K = max(M, M if slots is None else slots)
    home = [r for r in range(R) for _ in range(E // R + (r < E % R))]
    remote_R = [0] * R
    alloc = [[0] * R for _ in range(E)]
    for e, total in enumerate(counts_RE.sum(0).tolist()):
        ranks = [r for r in range(R) if r == home[e] or remote_R[r] < K]
        chosen = draw(st.lists(st.sampled_from(ranks), max_size=4, unique=True), label="ranks")
        chosen = chosen or [home[e]]
        cuts = sorted(
            draw(
                st.lists(st.integers(0, total), min_size=len(chosen) - 1, max_size=len(chosen) - 1)
            )
        )
        parts = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
        for r, n in zip(chosen, parts, strict=True):
            alloc[e][r] += n
            remote_R[r] += n > 0 and r != home[e]
    return torch.tensor(alloc, dtype=torch.int64).reshape(E, R)


@st.composite
def counts_and_options(
    draw: st.DrawFn, **counts_kwargs: Any
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Strategy for ``(counts_RE, options)``: :func:`counts` then matching :func:`plan_options`.

    Keyword arguments go to :func:`counts`.
    """
    counts_RE = draw(counts(**counts_kwargs))
    return counts_RE, draw(plan_options(*counts_RE.shape))


# ---- drawing ------------------------------------------------------------------------------------


@st.composite
def _counts(
    draw: st.DrawFn,
    ranks: tuple[int, int],
    experts: tuple[int, int],
    max_records: int,
    families: tuple[str, ...],
    sigma: float | None,
    empty_ranks: bool,
) -> torch.Tensor:
    R = draw(st.integers(*ranks), label="R")
    E = draw(st.integers(*experts), label="E")
    family = draw(st.sampled_from(families), label="family")
    if family == "zero":
        return torch.zeros(R, E, dtype=torch.int64)
    empty = (
        draw(st.sets(st.integers(0, R - 1), max_size=R), label="empty ranks")
        if empty_ranks
        else set()
    )
    if family == "random":
        cap = max(1, 2 * max_records // E)
        rows = [
            [0] * E if s in empty else draw(st.lists(st.integers(0, cap), min_size=E, max_size=E))
            for s in range(R)
        ]
        return torch.tensor(rows, dtype=torch.int64).reshape(R, E)
    records_R = draw(st.lists(st.integers(0, max_records), min_size=R, max_size=R), label="records")
    w_E = draw(_popularity(family, E, sigma))
    rows = [_apportion(0 if s in empty else n, w_E) for s, n in enumerate(records_R)]
    return torch.tensor(rows, dtype=torch.int64).reshape(R, E)


@st.composite
def _popularity(draw: st.DrawFn, family: str, E: int, sigma: float | None) -> list[float]:
    """Relative popularity ``w_E`` (positive floats) of one family."""
    if family == "uniform":
        return [1.0] * E
    if family == "lognormal":
        s = sigma if sigma is not None else draw(st.floats(0.0, 3.0), label="sigma")
        z_E = draw(st.lists(st.floats(-3.0, 3.0), min_size=E, max_size=E), label="z")
        return [math.exp(s * z) for z in z_E]
    if family == "zipf":
        exponent = draw(st.floats(0.5, 2.0), label="zipf_s")
        order = draw(st.permutations(range(E)), label="zipf ranks")
        return [(order.index(e) + 1.0) ** -exponent for e in range(E)]
    hot = draw(st.integers(0, E - 1), label="hot expert")
    share = draw(st.floats(0.5, 0.95), label="hot share")
    rest = (1.0 - share) / max(E - 1, 1)
    return [share if e == hot else rest for e in range(E)]


def _apportion(total: int, w_E: list[float]) -> list[int]:
    """Split ``total`` records in proportion to ``w_E`` (largest remainder, ties to low ids)."""
    scale = total / sum(w_E)
    exact = [w * scale for w in w_E]
    out = [int(x) for x in exact]
    by_remainder = sorted(range(len(w_E)), key=lambda e: (out[e] - exact[e], e))
    for e in by_remainder[: total - sum(out)]:
        out[e] += 1
    return out


def _check_bounds(name: str, low: int, high: int, *, least: int) -> None:
    if not (isinstance(low, int) and isinstance(high, int)) or not least <= low <= high:
        raise ValueError(f"{name}: need integers {least} <= min <= max, got {low}, {high}")
