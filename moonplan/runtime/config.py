"""``MoEConfig``: everything one moonplan MoE layer needs that is not a tensor or a group.

Legend: R ranks, E experts, M = ceil(E/R) home rows per rank, B slots, H hidden,
F expert FFN size, K top-k.

One frozen dataclass serves every front end (:class:`~moonplan.MoonMoE`,
:class:`~moonplan.adapters.MoonExperts`, torchtitan's
:class:`~moonplan.adapters.torchtitan.MoonGroupedExperts`, ``wrap``, ``wrap_model``,
``wrap_experts``) and the :class:`~moonplan.runtime.layer_runtime.LayerRuntime` they
build. The keyword options those front ends take are its fields; a keyword given
beside ``config=`` overrides that field (:meth:`MoEConfig.merged`). Each field is
checked when the config is made (``ValueError`` naming the field); sizes left
``None`` are read from the weights by the adapters (:meth:`MoEConfig.sized`). What a
layer runs with (:meth:`MoEConfig.resolve`) is agreed across ranks when it is built.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from moonplan.checks import check_int
from moonplan.runtime.balance import balance_mode
from moonplan.runtime.slot_budget import SlotsOption, resolve_slots
from moonplan.runtime.transports import registry as transports
from moonplan.stepcost import StepCost

SIZES = ("hidden_size", "ffn_size", "num_experts", "top_k")
DEPRECATED = ("choose", "search_us")
"""Fields accepted for one release, with a DeprecationWarning, and ignored."""


@dataclass(frozen=True)
class MoEConfig:
    """The options of one MoE layer (see the module docstring); every field has a default."""

    hidden_size: int | None = None
    """``H``; ``None``: read from the expert weights (adapters), required by ``MoonMoE``."""

    ffn_size: int | None = None
    """``F`` of each expert; ``None``: read from the expert weights."""

    num_experts: int | None = None
    """``E``; ``None``: read from the expert weights."""

    top_k: int | None = None
    """``K`` experts per token (``1 <= K <= E``); ``None``: read from the router/block."""

    slots: SlotsOption = None
    """Weight slots per rank for replicas: an ``int`` count ``B``, a byte budget
    (``"2GiB"`` or :class:`~moonplan.runtime.slot_budget.Bytes`) or a ``float`` fraction
    of the home experts' bytes; ``None``: ``min(2, M)``. Every form is capped at ``E``
    (``moonplan.runtime.slot_budget``)."""

    align: int = 1
    """Receive-row padding multiple (``>= 1``)."""

    max_tokens: int = 1024
    """Expected tokens per rank; sizes the receive buffers, which grow collectively when a
    step needs more (``>= 0``; the buffers must fit in the device's memory, checked
    before allocation: ``moonplan.runtime.buffers``)."""

    transport: str = "auto"
    """``"auto"`` (a symmetric heap where one spans the group, else all-to-all),
    ``"heap"`` or ``"a2a"``."""

    balance: str = "auto"
    """``"auto"`` (per step the plan with the least predicted step time), ``"exact"`` or
    ``"off"`` (static EP, the baseline); ``True``/``False`` are deprecated aliases of
    ``"exact"``/``"off"`` (``moonplan.runtime.balance``)."""

    dtype: torch.dtype | None = None
    """Dtype of the experts' GEMMs and of the rows and weights that move; ``None``:
    ``torch.get_default_dtype()`` for ``MoonMoE``, the weights' dtype for ``MoonExperts``,
    bf16 for torchtitan's experts."""

    overlap: bool = True
    """Run the weight prefetch beside the dispatch and the replica-gradient reduce beside
    the dispatch-backward; ``False`` runs them serially (bit-identical results)."""

    cost: StepCost | None = None
    """The :class:`~moonplan.stepcost.StepCost` ``balance="auto"`` plans with; ``None``:
    calibrated by the layer from its first measured steps."""

    choose: str | None = None
    """Deprecated and ignored: ``balance="auto"`` chooses inside its one planner call every
    step (``moonplan.plan.choice``); setting it warns. Removed in the next release."""

    search_us: float | None = None
    """Deprecated and ignored, as :attr:`choose` (it timed the host search that is gone)."""

    def __post_init__(self) -> None:
        for name in SIZES:  # a NumPy integer is kept as the Python int it equals
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(name, getattr(self, name), 1))
        E, K = self.num_experts, self.top_k
        if K is not None and E is not None and K > E:
            raise ValueError(f"top_k ({K}) cannot exceed num_experts ({E})")
        resolve_slots(self.slots, num_experts=1, ranks=1, hidden=1, ffn=1, dtype=torch.float32)
        object.__setattr__(self, "align", check_int("align", self.align, 1))
        object.__setattr__(self, "max_tokens", check_int("max_tokens", self.max_tokens, 0))
        if self.transport != "auto":
            transports.check(self.transport)  # a registered name (listed when unknown)
        object.__setattr__(self, "balance", balance_mode(self.balance, stacklevel=4))
        if self.dtype is not None and not (
            isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point
        ):
            raise ValueError(f"dtype must be a floating torch.dtype or None, got {self.dtype!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be a bool, got {self.overlap!r}")
        for name in DEPRECATED:
            if getattr(self, name) is not None:
                warnings.warn(
                    f"MoEConfig.{name} is deprecated and ignored: balance='auto' chooses "
                    "inside its one planner call every step (docs/planner-policy.md)",
                    DeprecationWarning,
                    stacklevel=4,
                )
                object.__setattr__(self, name, None)
        if self.cost is not None and not isinstance(self.cost, StepCost):
            raise ValueError(
                f"cost must be a moonplan.stepcost.StepCost or None, got {self.cost!r}"
            )

    @classmethod
    def merged(cls, config: MoEConfig | None, **fields: Any) -> MoEConfig:
        """``config`` (default: all defaults) with ``fields`` replaced.

        Raises:
            TypeError: a keyword that is not a field (as an unknown keyword argument would).
            ValueError: a field's value is invalid (see the field's docstring).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise TypeError(
                f"unexpected keyword argument(s) {', '.join(unknown)}; "
                f"the layer options are {', '.join(sorted(names))}"
            )
        base = config if config is not None else cls()
        if not isinstance(base, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(base).__name__}")
        return dataclasses.replace(base, **fields) if fields else base

    def sized(self, **sizes: Any) -> MoEConfig:
        """This config with the given sizes (``hidden_size=...``, ..., ``dtype=...``) filled in
        where they are ``None``.

        Raises:
            ValueError: a field that is set differs from the size the weights have.
        """
        for name, value in sizes.items():
            mine = getattr(self, name)
            if mine is not None and mine != value:
                raise ValueError(f"config.{name} is {mine}, but this layer's weights give {value}")
        unset = {n: v for n, v in sizes.items() if getattr(self, n) is None}
        return dataclasses.replace(self, **unset)

    def require_sizes(self) -> tuple[int, int, int, int]:
        """``(H, F, E, K)``.

        Raises:
            ValueError: naming the first size that is still ``None``.
        """
        for name in SIZES:
            if getattr(self, name) is None:
                raise ValueError(f"{name} is required (pass it or set MoEConfig.{name})")
        return self.hidden_size, self.ffn_size, self.num_experts, self.top_k  # type: ignore[return-value]

    def layer_dtype(self) -> torch.dtype:
        """The dtype the layer runs in: ``dtype``, or ``torch.get_default_dtype()``."""
        return self.dtype if self.dtype is not None else torch.get_default_dtype()

    def resolve(self, ranks: int) -> Resolved:
        """What a layer of this config runs with on ``ranks`` ranks (sizes required).

        Raises:
            ValueError: a size is ``None``, or a setting cannot be resolved (e.g. an
                unusable ``LOCAL_WORLD_SIZE`` for ``transport="a2a-hosts"``).
        """
        H, F, E, K = self.require_sizes()
        B = self.slot_count(ranks)
        options = transports.read_options(self.transport, ranks)
        agreed: dict[str, object] = {
            "hidden_size": H,
            "ffn_size": F,
            "num_experts": E,
            "top_k": K,
            "slots": B,
            "align": self.align,
            "max_tokens": self.max_tokens,
            "transport": self.transport,
            "balance": self.balance,
            "dtype": self.layer_dtype(),
            "overlap": self.overlap,
            **{_LABELS.get(name, name): value for name, value in options.items()},
            **cost_settings(self.cost),
        }
        return Resolved(B, options, agreed)

    def slot_count(self, ranks: int) -> int:
        """``B`` for this config on ``ranks`` ranks (sizes required)."""
        H, F, E, _ = self.require_sizes()
        return resolve_slots(
            self.slots, num_experts=E, ranks=ranks, hidden=H, ffn=F, dtype=self.layer_dtype()
        )


_LABELS = {"ranks_per_host": "ranks_per_host (LOCAL_WORLD_SIZE)"}
"""How a transport option read from the environment is named in a mismatch error."""


@dataclass(frozen=True)
class Resolved:
    """What a layer runs with (:meth:`MoEConfig.resolve`), agreed across ranks when it is
    built (``LayerRuntime``).

    Attributes:
        slots: ``B``, the resolved slot count.
        transport_options: what the transport read from the environment
            (``moonplan.runtime.transports.registry.read_options``), used for every
            transport the layer builds.
        agreed: every setting that shapes a step, by name, as compared across ranks:
            sizes, the resolved ``slots``, ``align``, ``max_tokens``, ``transport`` and its
            options, ``balance``, the resolved ``dtype``, ``overlap`` and the cost model's
            values (:func:`cost_settings`). Not ``choose``/``search_us`` (no-ops).
    """

    slots: int
    transport_options: dict[str, object]
    agreed: dict[str, object]


def cost_settings(cost: StepCost | None) -> dict[str, object]:
    """A cost model as agreed settings: ``{"cost": None}``, or its class name and each
    field's value (``cost.row_flop_s``, ..., ``cost.dispatch``), so that a mismatch names
    the field that differs."""
    if cost is None:
        return {"cost": None}
    values = {f"cost.{f.name}": getattr(cost, f.name) for f in dataclasses.fields(cost)}
    return {"cost": type(cost).__name__, **values}
