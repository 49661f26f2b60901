"""Input validation for the planner: one canonical counts tensor, or a PlanError.

Legend: R ranks, E experts, M = ceil(E/R), B slots, N total records (``counts.sum()``).

Limits (every one a :class:`PlanError` naming it, see ``docs/reliability.md``):

* ``N`` must fit in int64 (``2**63 - 1``): a larger total would wrap silently;
* ``slots <= E``: a rank never holds more than ``E`` distinct replicas;
* ``align <= max(65536, N rounded up to a power of two)``: any padding up to 65536 is
  accepted whatever the counts (a step may have no tokens), beyond that only what the
  records can use; and the padded rows, at most ``N + R * (M + max(M, B)) * (align - 1)``,
  must fit in int64.
"""

from __future__ import annotations

from typing import Any

import torch

from moonplan.errors import PlanError

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
INT64_MAX = 2**63 - 1
ALIGN_FREE = 1 << 16  # align up to this is accepted whatever the counts


def as_counts(
    counts: Any, num_ranks: int | None = None, *, check_values: bool = True
) -> torch.Tensor:
    """Validate ``counts`` and return it as an int64 tensor ``[R, E]``.

    Accepts a torch tensor, a numpy array or nested lists of integers. Raises
    :class:`PlanError` for anything that is not a 2-D, non-empty, non-negative
    integer array, or whose first dimension differs from ``num_ranks``.
    ``check_values=False`` skips the value check (negative entries), which reads
    the data on the host: on CUDA that is a synchronisation, so graph capture
    turns it off and relies on the caller.
    Nothing is modified: the result is a fresh tensor when a conversion is needed.
    """
    return checked_counts(counts, num_ranks, check_values=check_values)[0]


def checked_counts(
    counts: Any, num_ranks: int | None = None, *, check_values: bool = True
) -> tuple[torch.Tensor, int | None]:
    """:func:`as_counts` and the total ``N`` it read (``None`` without ``check_values``).

    The value check is one host read (minimum, maximum and sum stacked), so a caller
    that also needs ``N`` (:func:`check_options`'s ``total=``) reads the device once.
    """
    if not isinstance(counts, torch.Tensor):
        try:
            counts = torch.as_tensor(counts)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise PlanError(
                f"counts must be an integer array [R, E]; could not read it: {exc}"
            ) from None
    if counts.dtype not in _INT_DTYPES:
        raise PlanError(f"counts must have an integer dtype, got {counts.dtype}")
    if counts.dim() != 2:
        raise PlanError(
            f"counts must be 2-D [R, E] (source rank x expert), got shape {tuple(counts.shape)}"
        )
    R, E = counts.shape
    if R < 1 or E < 1:
        raise PlanError(f"counts must have at least one rank and one expert, got shape {(R, E)}")
    if num_ranks is not None and R != num_ranks:
        raise PlanError(f"counts has {R} rows (source ranks) but the group has {num_ranks} ranks")
    counts_RE = counts.to(torch.int64)
    if not check_values:
        return counts_RE, None
    return counts_RE, total_records(counts_RE)


def _raise_negative(counts_RE: torch.Tensor) -> None:
    """The PlanError naming the first negative entry (only once one is known to exist)."""
    s, e = (int(v) for v in (counts_RE < 0).nonzero()[0])
    raise PlanError(
        f"counts must be non-negative: counts[{s}, {e}] = {int(counts_RE[s, e])} "
        f"(source rank {s}, expert {e})"
    )


def total_records(counts_RE: torch.Tensor) -> int:
    """``N = counts.sum()`` of ``counts [R, E]``, exact; PlanError naming a negative entry,
    or a total beyond int64.

    One host read (one sync on accelerators): the minimum, maximum and sum in one
    stacked tensor. Only when ``max * numel`` could overflow is the exact total summed
    again on the host in Python integers.
    """
    lo_hi = torch.aminmax(counts_RE)
    low, top, total = torch.stack([lo_hi.min, lo_hi.max, counts_RE.sum()]).tolist()
    if low < 0:
        _raise_negative(counts_RE)
    if top * counts_RE.numel() <= INT64_MAX:  # no partial sum can wrap
        return int(total)
    total = sum(int(v) for v in counts_RE.reshape(-1).tolist())
    if total > INT64_MAX:
        raise PlanError(
            f"counts total {total} records, beyond the int64 limit 2**63 - 1 = {INT64_MAX}"
        )
    return int(total)


def check_options(
    slots: int | None,
    align: int,
    max_local: int,
    counts_RE: torch.Tensor | None = None,
    *,
    check_values: bool = True,
    total: int | None = None,
) -> int:
    """Validate ``slots`` and ``align``; return the slot count ``B`` (default ``M``).

    With ``counts_RE`` the limits of the module docstring apply too (``slots <= E``
    from its shape; the ``align`` limits read ``N`` on the host, so only with
    ``check_values``). ``total``: ``N`` already read by :func:`checked_counts` (no
    second host read).
    """
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise PlanError(f"align must be an integer >= 1, got {align!r}")
    B = max_local if slots is None else slots
    if isinstance(B, bool) or not isinstance(B, int) or B < 0:
        raise PlanError(f"slots must be an integer >= 0, got {slots!r}")
    if counts_RE is None:
        return B
    R, E = counts_RE.shape
    if B > E:
        raise PlanError(f"slots={B} exceeds the limit E = {E} experts (a rank never holds more)")
    if check_values:
        N = total_records(counts_RE) if total is None else total
        _check_align(align, N, R * (max_local + max(max_local, B)))
    return B


def check_previous(got_REB: tuple[int, int, int], want_REB: tuple[int, int, int]) -> None:
    """A previous plan's ``(R, E, B)`` against this call's (``moonplan.plan``'s
    ``previous=``, and the plan a choose-ahead search starts from).

    Raises:
        PlanError: naming both shapes.
    """
    if tuple(got_REB) != tuple(want_REB):
        raise PlanError(
            f"previous plan has (R, E, B) = {tuple(got_REB)}, this call has {tuple(want_REB)}"
        )


def _check_align(align: int, N: int, rows: int) -> None:
    """``align`` against ``N`` records spread over at most ``rows`` padded rows."""
    limit = max(ALIGN_FREE, 1 << max(N - 1, 0).bit_length())
    if align > limit:
        raise PlanError(
            f"align={align} exceeds the limit max({ALIGN_FREE}, N rounded up to a power of "
            f"two) = {limit} for N = {N} records"
        )
    if N + rows * (align - 1) > INT64_MAX:
        raise PlanError(
            f"align={align}: {N} records padded over up to {rows} rows overflow int64 "
            f"(limit N + rows * (align - 1) <= 2**63 - 1)"
        )
