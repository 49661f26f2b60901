"""The ``slots=`` option: a number of weight slots per rank, or a memory budget.

Legend: E experts, R ranks, M = ceil(E/R) home rows per rank, H hidden, F ffn,
``expert_bytes = 3 * H * F * itemsize`` (``gate_up [2F, H]`` and ``down [H, F]``).

``slots`` may be

* an ``int``: that many slots ``B`` per rank;
* bytes: :class:`Bytes` or a string with a binary or decimal unit (``"2GiB"``,
  ``"512MiB"``, ``"1.5GB"``, ``"4096"``): ``B = floor(bytes / expert_bytes)``;
* a ``float`` in ``[0, inf)``: a fraction of the home experts' bytes,
  ``B = floor(fraction * M)`` (``1.0`` reserves as much again as the rank's own experts);
* ``None``: :func:`default_slots`.

``B`` is capped at ``E`` whatever the form (a rank never holds more distinct replicas;
the planner refuses more), so no ``slots=`` value reserves more than ``E`` experts' weights
per rank. Replicas
beyond ``B`` still run: their weights are read from the home rank when the experts
run ("direct reads", reported per step in ``last_stats.direct_reads``).

``refill_rows=S`` adds staging rows for background refills
(:mod:`moonplan.runtime.refill`): :func:`resolve_rows` gives ``(B, S)``, ``S = min(S, B)``
(a refill changes at most ``B`` slots). Every form of ``slots`` buys slots only: the
staging rows come on top, once per device for every layer of the same shapes, which share
them (:mod:`moonplan.runtime.staging`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from moonplan.plan.home import max_local

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
DEFAULT_SLOTS = 2
"""Default ``B`` (capped at ``M``): measured with ``bench/bench_layer.py``, see docs/runtime.md."""


@dataclass(frozen=True)
class Bytes:
    """A memory budget in bytes (``slots=Bytes(2 << 30)``), so an int stays a slot count."""

    nbytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"Bytes needs an integer >= 0, got {self.nbytes!r}")


SlotsOption = int | float | str | Bytes | None
"""What ``slots=`` accepts."""


def parse_bytes(text: str) -> int:
    """``"2GiB"`` -> ``2147483648``; units B, kB/MB/GB/TB (10^3) and KiB/MiB/GiB/TiB (2^10).

    Raises:
        ValueError: not a number with one of those units.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read a byte size from {text!r}: use e.g. '2GiB', '512MiB', '1.5GB'"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value):  # e.g. "1e400": beyond a float, not a size
        raise ValueError(f"cannot read a byte size from {text!r}: not a finite number of bytes")
    return int(value)


def expert_bytes(hidden: int, ffn: int, dtype: torch.dtype) -> int:
    """Bytes of one expert's weights (``gate_up`` and ``down``)."""
    return 3 * hidden * ffn * torch.empty((), dtype=dtype).element_size()


def default_slots(num_experts: int, ranks: int) -> int:
    """``min(DEFAULT_SLOTS, M)``."""
    return min(DEFAULT_SLOTS, max_local(num_experts, ranks))


def resolve_slots(
    slots: SlotsOption,
    *,
    num_experts: int,
    ranks: int,
    hidden: int,
    ffn: int,
    dtype: torch.dtype,
) -> int:
    """The slot count ``B`` for a ``slots=`` value (see the module docstring; the refill
    staging rows come on top: :func:`resolve_rows`).

    Raises:
        ValueError: a negative count or fraction, an unreadable or infinite size, another
            type (each names ``slots``).
    """
    E, M = num_experts, max_local(num_experts, ranks)
    if slots is None:
        return default_slots(E, ranks)
    if isinstance(slots, bool):
        raise ValueError(f"slots must be a count, a byte budget or a fraction, got {slots!r}")
    if isinstance(slots, int):
        if slots < 0:
            raise ValueError(f"slots must be >= 0, got {slots}")
        return min(E, slots)
    if isinstance(slots, float):
        if not math.isfinite(slots) or slots < 0:
            raise ValueError(f"slots as a fraction must be finite and >= 0, got {slots}")
        return math.floor(min(slots * M, E) + 1e-9)  # slots * M may overflow to inf
    if isinstance(slots, str):
        try:
            slots = Bytes(parse_bytes(slots))
        except ValueError as exc:
            raise ValueError(f"slots: {exc}") from None
    if isinstance(slots, Bytes):
        return min(E, slots.nbytes // expert_bytes(hidden, ffn, dtype))
    raise ValueError(
        f"slots must be an int, a float fraction, a byte string or Bytes, got {slots!r}"
    )


def resolve_rows(
    slots: SlotsOption,
    refill_rows: int,
    *,
    num_experts: int,
    ranks: int,
    hidden: int,
    ffn: int,
    dtype: torch.dtype,
) -> tuple[int, int]:
    """``(B, S)``: slots and refill staging rows per rank for ``slots=`` and
    ``refill_rows=`` (the module docstring: the staging rows come on top, shared by the
    layers).

    Raises:
        ValueError: as :func:`resolve_slots`, or ``refill_rows`` is not an int ``>= 0``.
    """
    if isinstance(refill_rows, bool) or not isinstance(refill_rows, int) or refill_rows < 0:
        raise ValueError(f"refill_rows must be an int >= 0, got {refill_rows!r}")
    B = resolve_slots(
        slots, num_experts=num_experts, ranks=ranks, hidden=hidden, ffn=ffn, dtype=dtype
    )
    return B, min(refill_rows, B)
