"""The four sections of a ``MoEConfig``: sizes, buffers, transfer and balancing.

Legend: R ranks, E experts, M = ceil(E/R) home rows per rank, B slots, H hidden,
F expert FFN size, K top-k.

Each section is a frozen dataclass that checks its own fields when it is made
(``ValueError`` naming the field). Every field is a layer option of the same name
(``MoonMoE(..., slots=2)`` sets ``Buffers.slots``) with a default; the section's
``MEANING`` says in one line what each means, and ``docs/api.md``'s option table is
generated from them ``docs/api.md``'s option table is generated
(:func:`moonplan.runtime.config.table.option_table`).

The ``balance=`` modes: ``"auto"`` (default: per step the plan with the least predicted
step time among the planner's candidates, by the runtime's
:class:`~moonplan.stepcost.StepCost`; see ``docs/runtime.md``), ``"exact"`` (every step
the exactly balanced plan) and ``"off"`` (static expert parallelism, the baseline).
``True``/``False`` (the old bool) are accepted for one release with a
``DeprecationWarning`` and mean ``"exact"``/``"off"``. How ``"auto"`` measures its own
cost model runs by the constants below (:mod:`moonplan.runtime.balancer`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from moonplan.checks import check_int
from moonplan.plan.home_order import check_order
from moonplan.runtime.slot_budget import SlotsOption, resolve_slots
from moonplan.runtime.transports import registry as transports
from moonplan.stepcost import StepCost

MODES = ("auto", "exact", "off")
DEFAULT = "auto"

WARMUP_STEPS = 4
"""Measured exact steps before ``"auto"`` calibrates its own cost model: enough for the
median of each phase to ignore one outlier (the first step is never measured)."""

KEEP_SAMPLES = 32
"""Most recent step samples kept for ``calibrate()``."""

TIMING_REPEATS = 3
"""Planner calls timed per path when calibrating (their median is kept)."""

DEPRECATED = ("choose", "search_us")
"""Options accepted for one release, with a DeprecationWarning, and ignored."""

_TO_CALLER = 5
"""``stacklevel`` of a warning raised while a section checks itself: the caller of
``MoEConfig(...)`` (warn, ``__post_init__``, the section's ``__init__``, ``MoEConfig``)."""


def balance_mode(value: str | bool, *, stacklevel: int = 3) -> str:
    """The mode ``value`` names; bools map to ``"exact"``/``"off"`` with a DeprecationWarning.

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, bool):
        mode = "exact" if value else "off"
        warnings.warn(
            f"balance={value} is deprecated; use balance={mode!r} "
            f"(modes: {', '.join(MODES)}; default {DEFAULT!r})",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        return mode
    if value not in MODES:
        raise ValueError(f"balance must be one of {MODES}, got {value!r}")
    return value


@dataclass(frozen=True)
class Sizes:
    """What the expert weights give: ``H``, ``F``, ``E``, ``K`` and the dtype; and the
    experts' home order (a permutation of the ``E`` experts, checked against ``E``)."""

    hidden_size: int | None = None
    ffn_size: int | None = None
    num_experts: int | None = None
    top_k: int | None = None
    dtype: torch.dtype | None = None
    home_order: Sequence[int] | None = None

    MEANING: ClassVar[dict[str, str]] = {
        "hidden_size": "``H``; ``None``: read from the expert weights, required by MoonMoE",
        "ffn_size": "``F`` of each expert; ``None``: read from the expert weights",
        "num_experts": "``E``; ``None``: read from the expert weights",
        "top_k": "``K`` experts per token (``1 <= K <= E``); ``None``: read from the router",
        "dtype": "dtype of the experts' GEMMs and of the rows and weights that move; ``None``: "
        "the default dtype (MoonMoE), the weights' (MoonExperts), bf16 (torchtitan's experts)",
        "home_order": "which experts each rank owns: label ``i`` is model expert "
        "``home_order[i]`` and rank ``r`` owns the labels of its linear block (a permutation "
        "of the ``E`` experts, e.g. ``moonplan.plan.home_order.popular_order``); ``None``: "
        "the identity (rank ``r`` owns experts of its block's ids)",
    }

    def __post_init__(self) -> None:
        for name in ("hidden_size", "ffn_size", "num_experts", "top_k"):
            value = getattr(self, name)  # a NumPy integer is kept as the Python int it equals
            if value is not None:
                object.__setattr__(self, name, check_int(name, value, 1))
        E, K = self.num_experts, self.top_k
        if K is not None and E is not None and K > E:
            raise ValueError(f"top_k ({K}) cannot exceed num_experts ({E})")
        if self.dtype is not None and not (
            isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point
        ):
            raise ValueError(f"dtype must be a floating torch.dtype or None, got {self.dtype!r}")
        if self.home_order is not None:
            object.__setattr__(self, "home_order", tuple(check_order(self.home_order, E)))

    def require(self) -> tuple[int, int, int, int]:
        """``(H, F, E, K)``.

        Raises:
            ValueError: naming the first size that is still ``None``.
        """
        H, F, E, K = self.hidden_size, self.ffn_size, self.num_experts, self.top_k
        for name, value in (("hidden_size", H), ("ffn_size", F), ("num_experts", E), ("top_k", K)):
            if value is None:
                raise ValueError(f"{name} is required (pass it or set MoEConfig.{name})")
        return H, F, E, K  # type: ignore[return-value]


@dataclass(frozen=True)
class Buffers:
    """The weight slots and receive rows each rank allocates."""

    slots: SlotsOption = None
    align: int = 1
    max_tokens: int = 1024
    refill_rows: int = 1

    MEANING: ClassVar[dict[str, str]] = {
        "slots": "weight slots per rank for replicas: an ``int`` count, a byte budget "
        "(``'2GiB'``, ``Bytes``) or a ``float`` fraction of the home experts' bytes; ``None``: "
        "``min(2, M)``; capped at ``E``",
        "align": "receive-row padding multiple (``>= 1``)",
        "max_tokens": "expected tokens per rank: sizes the receive buffers, which grow "
        "collectively when a step needs more (``>= 0``; checked against the device's memory)",
        "refill_rows": "staging rows per rank for a background refill of the slots (at most "
        "that many slots change per rank per refill; ``0``: no refills): on top of the slots, "
        "once per device, shared by every layer of the same shapes (one refill at a time); "
        "at most ``B``",
    }

    def __post_init__(self) -> None:
        resolve_slots(self.slots, num_experts=1, ranks=1, hidden=1, ffn=1, dtype=torch.float32)
        object.__setattr__(self, "align", check_int("align", self.align, 1))
        object.__setattr__(self, "max_tokens", check_int("max_tokens", self.max_tokens, 0))
        object.__setattr__(self, "refill_rows", check_int("refill_rows", self.refill_rows, 0))


@dataclass(frozen=True)
class Transfer:
    """How rows and weights move between ranks."""

    transport: str = "auto"
    overlap: bool = True

    MEANING: ClassVar[dict[str, str]] = {
        "transport": "``'auto'`` (a symmetric heap where one spans the group, else all-to-all) "
        "or a registered transport name (``'heap'``, ``'a2a'``, ...)",
        "overlap": "run the weight prefetch beside the dispatch and the replica-gradient "
        "reduce beside the dispatch-backward; ``False``: serially (bit-identical results)",
    }

    def __post_init__(self) -> None:
        if self.transport != "auto":
            transports.check(self.transport)  # a registered name (listed when unknown)
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be a bool, got {self.overlap!r}")


@dataclass(frozen=True)
class Balancing:
    """How each step is planned (the ``balance=`` modes: module docstring)."""

    balance: str = DEFAULT
    cost: StepCost | None = None
    choose: str | None = None
    search_us: float | None = None
    rehome: bool = True

    MEANING: ClassVar[dict[str, str]] = {
        "balance": "``'auto'`` (per step the plan with the least predicted step time), "
        "``'exact'`` or ``'off'`` (static EP); ``True``/``False``: deprecated exact/off",
        "cost": "the ``StepCost`` that ``balance='auto'`` plans with; ``None``: calibrated by "
        "the layer from its first measured steps",
        "choose": "deprecated and ignored (warns): auto chooses inside one planner call",
        "search_us": "deprecated and ignored (warns), as ``choose``",
        "rehome": "``balance='auto'`` re-homes by itself: serving, once, when its 32-step "
        "window fills, where its cost model favours an order of its loads "
        "(whole or per replica); "
        "training, where its decisions' rent or buy says (the moves priced with the "
        "optimizer's state), at the start of a step; ``False``: never",
    }

    def __post_init__(self) -> None:
        mode = balance_mode(self.balance, stacklevel=_TO_CALLER + 1)
        object.__setattr__(self, "balance", mode)
        if not isinstance(self.rehome, bool):
            raise ValueError(f"rehome must be True or False, got {self.rehome!r}")
        if self.cost is not None and not isinstance(self.cost, StepCost):
            raise ValueError(
                f"cost must be a moonplan.stepcost.StepCost or None, got {self.cost!r}"
            )
        for name in DEPRECATED:
            if getattr(self, name) is not None:
                warnings.warn(
                    f"MoEConfig.{name} is deprecated and ignored: balance='auto' chooses "
                    "inside its one planner call every step (docs/planner-policy.md)",
                    DeprecationWarning,
                    stacklevel=_TO_CALLER,
                )
                object.__setattr__(self, name, None)


Section = Sizes | Buffers | Transfer | Balancing

SECTIONS: dict[str, type[Section]] = {
    "sizes": Sizes,
    "buffers": Buffers,
    "transfer": Transfer,
    "balancing": Balancing,
}
"""The sections of a ``MoEConfig``, by attribute name, in the docs' order."""
