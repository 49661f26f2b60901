"""``MoEConfig``: everything one moonplan MoE layer needs that is not a tensor or a group.

Legend: R ranks, E experts, M = ceil(E/R) home rows per rank, B slots, H hidden,
F expert FFN size, K top-k.

One frozen tree of four typed sections (:mod:`moonplan.runtime.config.sections`):
``sizes`` (H, F, E, K, dtype, home_order), ``buffers`` (slots, align, max_tokens,
refill_rows), ``transfer`` (transport, overlap) and ``balancing`` (balance, cost, rehome). It
serves every front end (:class:`~moonplan.MoonMoE`,
:class:`~moonplan.adapters.MoonExperts`, torchtitan's
:class:`~moonplan.adapters.torchtitan.MoonGroupedExperts`, ``wrap``, ``wrap_model``,
``wrap_experts``) and the :class:`~moonplan.runtime.layer_runtime.LayerRuntime` they
build. It is made from the layer options as keywords (``MoEConfig(slots=2)``), each read
back by its own name too (``config.slots`` is ``config.buffers.slots``); a keyword given
beside ``config=`` replaces that option (:meth:`MoEConfig.merged`,
:meth:`MoEConfig.replace`). Each section checks its fields when it is made
(``ValueError`` naming the field); sizes left ``None`` are read from the weights by the
adapters (:meth:`MoEConfig.sized`). What a layer runs with (:meth:`MoEConfig.resolve`) is
agreed across ranks when it is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moonplan.runtime.config.sections import (
    SECTIONS,
    Balancing,
    Buffers,
    Sizes,
    Transfer,
)
from moonplan.runtime.slot_budget import SlotsOption, resolve_rows
from moonplan.runtime.transports import registry as transports
from moonplan.stepcost import StepCost

OPTIONS = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
"""Every layer option -> the section that holds it (``"slots"`` -> ``"buffers"``)."""


@dataclass(frozen=True, init=False)
class MoEConfig:
    """The options of one MoE layer (see the module docstring); every option has a default.

    Attributes:
        sizes: :class:`~moonplan.runtime.config.sections.Sizes`.
        buffers: :class:`~moonplan.runtime.config.sections.Buffers`.
        transfer: :class:`~moonplan.runtime.config.sections.Transfer`.
        balancing: :class:`~moonplan.runtime.config.sections.Balancing`.

    Each option is also an attribute of its own name (``config.top_k``).
    ``dataclasses.replace`` does not apply (the fields are the sections): use
    :meth:`replace`.
    """

    sizes: Sizes
    buffers: Buffers
    transfer: Transfer
    balancing: Balancing

    def __init__(
        self,
        hidden_size: int | None = None,
        ffn_size: int | None = None,
        num_experts: int | None = None,
        top_k: int | None = None,
        slots: SlotsOption = None,
        align: int = 1,
        max_tokens: int = 1024,
        transport: str = "auto",
        balance: str | bool = "auto",
        dtype: torch.dtype | None = None,
        overlap: bool = True,
        cost: StepCost | None = None,
        choose: str | None = None,
        search_us: float | None = None,
        refill_rows: int = 1,
        home_order: Sequence[int] | None = None,
        rehome: bool = True,
    ) -> None:
        """The options as keywords (their meaning: the sections; the order of old)."""
        put = object.__setattr__
        put(self, "sizes", Sizes(hidden_size, ffn_size, num_experts, top_k, dtype, home_order))
        put(self, "buffers", Buffers(slots, align, max_tokens, refill_rows))
        put(self, "transfer", Transfer(transport, overlap))
        balancing = Balancing(balance, cost, choose, search_us, rehome)  # type: ignore[arg-type]
        put(self, "balancing", balancing)

    def __getattr__(self, name: str) -> Any:
        """An option by its own name: ``config.slots`` is ``config.buffers.slots``."""
        section = OPTIONS.get(name)
        if section is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, section), name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(OPTIONS))

    def options(self) -> dict[str, Any]:
        """Every option by name, section by section (keywords that rebuild this config)."""
        return {name: getattr(getattr(self, section), name) for name, section in OPTIONS.items()}

    def replace(self, **changes: Any) -> MoEConfig:
        """This config with some options changed, checked like a new one: options by name
        (``slots=4``) or whole sections (``buffers=Buffers(...)``); an option given beside
        its section wins.

        Raises:
            TypeError: a name that is neither an option nor a section, or a section of
                the wrong type.
            ValueError: an option's value is invalid (see its section).
        """
        _check_names(changes)
        values = self.options()
        for name, section in changes.items():
            if name in SECTIONS:
                if not isinstance(section, SECTIONS[name]):
                    want = SECTIONS[name].__name__
                    raise TypeError(f"{name} must be a {want}, got {type(section).__name__}")
                values.update({f.name: getattr(section, f.name) for f in _fields(name)})
        values.update({n: v for n, v in changes.items() if n in OPTIONS})
        return type(self)(**values)

    @classmethod
    def merged(cls, config: MoEConfig | None, **fields: Any) -> MoEConfig:
        """``config`` (default: all defaults) with ``fields`` replaced (:meth:`replace`).

        Raises:
            TypeError: a keyword that is not an option (as an unknown keyword argument
                would), or ``config`` is not a ``MoEConfig``.
            ValueError: an option's value is invalid (see its section).
        """
        _check_names(fields)
        base = config if config is not None else cls()
        if not isinstance(base, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(base).__name__}")
        return base.replace(**fields) if fields else base

    def sized(self, **sizes: Any) -> MoEConfig:
        """This config with the given sizes (``hidden_size=...``, ..., ``dtype=...``) filled in
        where they are ``None``.

        Raises:
            ValueError: a size that is set differs from the size the weights have.
        """
        for name, value in sizes.items():
            if OPTIONS.get(name) != "sizes":
                raise TypeError(f"sized() takes the sizes section's options, not {name!r}")
            mine = getattr(self.sizes, name)
            if mine is not None and mine != value:
                raise ValueError(f"config.{name} is {mine}, but this layer's weights give {value}")
        unset = {n: v for n, v in sizes.items() if getattr(self.sizes, n) is None}
        return self.replace(**unset) if unset else self

    def require_sizes(self) -> tuple[int, int, int, int]:
        """``(H, F, E, K)``.

        Raises:
            ValueError: naming the first size that is still ``None``.
        """
        return self.sizes.require()

    def layer_dtype(self) -> torch.dtype:
        """The dtype the layer runs in: ``dtype``, or ``torch.get_default_dtype()``."""
        dtype = self.sizes.dtype
        return dtype if dtype is not None else torch.get_default_dtype()

    def resolve(self, ranks: int) -> Resolved:
        """What a layer of this config runs with on ``ranks`` ranks (sizes required).

        Raises:
            ValueError: a size is ``None``, or a setting cannot be resolved (e.g. an
                unusable ``LOCAL_WORLD_SIZE`` for ``transport="a2a-hosts"``).
        """
        H, F, E, K = self.require_sizes()
        B, S = self.slot_rows(ranks)
        options = transports.read_options(self.transfer.transport, ranks)
        agreed: dict[str, object] = {
            "hidden_size": H,
            "ffn_size": F,
            "num_experts": E,
            "top_k": K,
            "home_order": self.sizes.home_order,
            "slots": B,
            "refill_rows": S,
            "align": self.buffers.align,
            "max_tokens": self.buffers.max_tokens,
            "transport": self.transfer.transport,
            "balance": self.balancing.balance,
            "rehome": self.balancing.rehome,
            "dtype": self.layer_dtype(),
            "overlap": self.transfer.overlap,
            **{_LABELS.get(name, name): value for name, value in options.items()},
            **cost_settings(self.balancing.cost),
        }
        return Resolved(B, options, agreed, S)

    def slot_count(self, ranks: int) -> int:
        """``B`` for this config on ``ranks`` ranks (sizes required)."""
        return self.slot_rows(ranks)[0]

    def slot_rows(self, ranks: int) -> tuple[int, int]:
        """``(B, S)``: slots and refill staging rows per rank for this config on ``ranks``
        ranks (sizes required; :func:`~moonplan.runtime.slot_budget.resolve_rows`)."""
        H, F, E, _ = self.require_sizes()
        return resolve_rows(
            self.buffers.slots,
            self.buffers.refill_rows,
            num_experts=E,
            ranks=ranks,
            hidden=H,
            ffn=F,
            dtype=self.layer_dtype(),
        )


def _fields(section: str) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(SECTIONS[section])


def _check_names(given: dict[str, Any]) -> None:
    """``TypeError`` for a keyword that is neither an option nor a section."""
    unknown = sorted(set(given) - set(OPTIONS) - set(SECTIONS))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(unknown)}; "
            f"the layer options are {', '.join(sorted(OPTIONS))}"
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
            sizes, ``home_order``, the resolved ``slots`` and ``refill_rows``, ``align``,
            ``max_tokens``, ``transport`` and its options, ``balance``, the resolved
            ``dtype``, ``overlap`` and the cost model's values (:func:`cost_settings`). Not
            ``choose``/``search_us`` (no-ops).
        refill_rows: ``S``, the resolved refill staging rows per rank (``<= B``).
    """

    slots: int
    transport_options: dict[str, object]
    agreed: dict[str, object]
    refill_rows: int = 0


def cost_settings(cost: StepCost | None) -> dict[str, object]:
    """A cost model as agreed settings: ``{"cost": None}``, or its class name and each
    field's value (``cost.row_flop_s``, ..., ``cost.dispatch``), so that a mismatch names
    the field that differs."""
    if cost is None:
        return {"cost": None}
    values = {f"cost.{name}": v for name, v in dataclasses.asdict(cost).items()}
    return {"cost": type(cost).__name__, **values}
