"""Per-rank targets between exact balance and the static loads: capped water-filling.

Legend:
    R ranks    K levels (``LEVELS``)    N records in all
    L[r]       static load of rank r (records of its home experts)
    m          ceil(N / R): the least possible largest load
    cap        every rank's target is at most ``cap`` (``m <= cap <= max L``)

``water_fill(L, cap)``: ranks above ``cap`` shed down to it; the shed records ``S`` raise
the lowest loads to a common level ``t`` (the largest integer with
``sum over ranks at or below cap of max(0, t - L[r]) <= S``), the ``extra`` records left
go one each to the lowest-id ranks at or below ``t``; every other rank keeps its load.
Every target is at most ``cap`` and a donor's target (``cap``) is at least every other
target, which is what the group-flow construction needs (``moonplan/plan/README.md``,
"Other targets"); with no rank above ``cap`` the targets are the static loads.

``level_caps(L, K)``: the caps ``m + floor((max L - m) * k / K)`` for ``k = 1 .. K - 1``,
evenly spaced between exact balance (``k = 0``, planned with the exact targets) and
static EP (``k = K``). ``auto`` builds one candidate per level (``moonplan.plan.choice``).

Two forms with equal results: plain Python integers (the definition) and torch (any
device, no host read, shapes fixed by ``R`` and ``K``).

The named policy ``"bounded-<eps>"`` is the same water-filling under
``cap = ceil(N / R * (1 + eps))`` (:func:`bounded_cap`).
"""

from __future__ import annotations

from fractions import Fraction

import torch


def level_caps(load: list[int], levels: int) -> list[int]:
    """The ``levels - 1`` interior caps of ``load`` (module docstring), ascending ``k``."""
    R, N = len(load), sum(load)
    m = -(-N // R)
    gap = max(load) - m
    return [m + max(0, _scaled(gap, k, levels)) for k in range(1, levels)]


def _scaled(gap: int, k: int, levels: int) -> int:
    """``floor(gap * k / levels)`` without forming ``gap * k`` (no int64 overflow)."""
    q, r = divmod(gap, levels)
    return q * k + r * k // levels


def water_fill(load: list[int], cap: int) -> list[int]:
    """The targets of ``load`` under ``cap`` (module docstring), plain Python integers.

    ``cap`` must be at least ``ceil(sum(load) / len(load))``.
    """
    shed = sum(x - cap for x in load if x > cap)
    if shed == 0:
        return list(load)
    below = sorted(x for x in load if x <= cap)
    level, used = below[0], 0
    for i, x in enumerate(below):  # raise the i lowest ranks from `level` to `x`
        if used + (x - level) * i > shed:
            break
        used, level = used + (x - level) * i, x
    lift, extra = divmod(shed - used, sum(1 for x in below if x <= level))
    level += lift
    target = []
    for x in load:
        if x > cap:
            target.append(cap)
        elif x <= level:
            target.append(level + (1 if extra > 0 else 0))
            extra -= 1
        else:
            target.append(x)
    return target


def level_caps_torch(load_R: torch.Tensor, levels: int) -> torch.Tensor:
    """int64 ``[levels - 1]``: :func:`level_caps` of ``load_R`` (int64 ``[R]``), on its device."""
    R = load_R.shape[0]
    m = (load_R.sum() + (R - 1)) // R
    gap = (load_R.max() - m).clamp(min=0)
    k = torch.arange(1, levels, device=load_R.device)
    return m + (gap // levels) * k + (gap % levels) * k // levels


def water_fill_torch(load_R: torch.Tensor, cap_K: torch.Tensor) -> torch.Tensor:
    """int64 ``[K, R]``: :func:`water_fill` of ``load_R`` (int64 ``[R]``) under each cap
    of ``cap_K`` (int64 ``[K]``), with no host read.

    The lowest ``i`` loads (sorted ascending ``l_1 <= ... <= l_R``) need
    ``f_i = (i - 1) * l_i - (l_1 + ... + l_{i-1})`` records to reach ``l_i``; ``f`` does
    not decrease, so the level's last rank is the count of ``i`` at or below cap with
    ``f_i <= S``, and the level is ``l_i + (S - f_i) // i``.
    """
    R = load_R.shape[0]
    cap_K1 = cap_K[:, None]
    shed_K = (load_R[None, :] - cap_K1).clamp(min=0).sum(1)
    below_KR = load_R[None, :] <= cap_K1
    l_R = torch.sort(load_R).values
    i_R = torch.arange(1, R + 1, device=load_R.device)
    f_R = (i_R - 1) * l_R - (l_R.cumsum(0) - l_R)
    n_K = below_KR.sum(1)  # ranks at or below the cap (the lowest n of the sorted loads)
    i_K = ((f_R[None, :] <= shed_K[:, None]) & (i_R[None, :] <= n_K[:, None])).sum(1)
    at_K = (i_K - 1).clamp(min=0)
    l_K, f_K = l_R[at_K], f_R[at_K]
    i_K = i_K.clamp(min=1)
    level_K = l_K + (shed_K - f_K) // i_K
    extra_K = (shed_K - f_K) % i_K
    low_KR = below_KR & (load_R[None, :] <= level_K[:, None])
    bump_KR = low_KR & (low_KR.cumsum(1) <= extra_K[:, None])
    target_KR = torch.where(low_KR, level_K[:, None], load_R[None, :]) + bump_KR.to(torch.int64)
    target_KR = torch.where(below_KR, target_KR, cap_K1)
    return torch.where((shed_K > 0)[:, None], target_KR, load_R[None, :])


BOUNDED_PREFIX = "bounded-"


def parse_bounded(name: str) -> Fraction | None:
    """``eps >= 0`` of a ``"bounded-<eps>"`` policy name (an exact decimal), else ``None``."""
    if not name.startswith(BOUNDED_PREFIX):
        return None
    text = name[len(BOUNDED_PREFIX) :]
    if text != text.strip():
        return None
    try:
        eps = Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None
    return eps if eps >= 0 else None


def bounded_cap(total: int, num_ranks: int, eps: Fraction) -> int:
    """``cap = ceil(N / R * (1 + eps))`` in exact integer arithmetic (``bounded-<eps>``)."""
    p, q = eps.numerator, eps.denominator
    return -(-total * (q + p) // (q * num_ranks))
