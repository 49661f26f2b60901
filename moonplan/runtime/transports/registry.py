"""Transports by name: ``register(name, factory)``, ``create(name, group, ...)``, ``names()``.

Legend: none (builds objects; see :mod:`moonplan.runtime.transports.base`).

A factory is called as ``factory(group, capacity=C, hidden=H, dtype=dtype, heap=heap,
**options)`` and returns a :class:`~moonplan.runtime.transports.base.Transport`; ``heap``
is the layer's symmetric heap for transports registered with ``needs_heap=True`` (the
runtime creates one for them) and ``None`` otherwise. ``options`` are what the
transport's ``options`` function (given to :func:`register`, if any; read with
:func:`read_options`) resolved from the
environment when the layer was built (``a2a-hosts``: ``ranks_per_host`` from
``LOCAL_WORLD_SIZE``): the layer agrees them across ranks with its config and builds
every transport of its life with them, so a step never runs on values that differ
between ranks or that changed since. The runtime picks its
transport by name through :func:`create`; the built-in ones are registered at the
bottom of this file (adding a transport: CONTRIBUTING.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap
from moonplan.runtime.transports.all_to_all import AllToAllTokenTransport, AllToAllTransport
from moonplan.runtime.transports.base import Transport
from moonplan.runtime.transports.heap import HeapTokenTransport, HeapTransport
from moonplan.runtime.transports.two_stage import TwoStageTokenTransport, host_options

Factory = Callable[..., Transport]
Options = Callable[[int], dict[str, object]]
"""``options(R)``: the settings a transport reads from the environment for ``R`` ranks."""


@dataclass(frozen=True)
class _Entry:
    factory: Factory
    needs_heap: bool
    options: Options | None


_REGISTRY: dict[str, _Entry] = {}  # the one registry: filled by register() calls below


def register(
    name: str, factory: Factory, *, needs_heap: bool = False, options: Options | None = None
) -> None:
    """Make ``create(name, ...)`` call ``factory``; a name is registered once. ``options``:
    what the transport reads from the environment (module docstring)."""
    if name in _REGISTRY or name == "auto":
        raise ValueError(f"transport name {name!r} is taken (registered: {', '.join(names())})")
    _REGISTRY[name] = _Entry(factory, needs_heap, options)


def names() -> tuple[str, ...]:
    """The registered transport names, sorted."""
    return tuple(sorted(_REGISTRY))


def check(name: str) -> None:
    """Raise ``ValueError`` listing the known names unless ``name`` is registered."""
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown transport {name!r}; known transports: {', '.join(names())} "
            "(or 'auto' for a layer: the heap where one spans the group, else a2a)"
        )


def needs_heap(name: str) -> bool:
    """Whether transport ``name`` works on a symmetric heap the runtime provides."""
    check(name)
    return _REGISTRY[name].needs_heap


def read_options(name: str, num_ranks: int) -> dict[str, object]:
    """What transport ``name`` reads from the environment for ``num_ranks`` ranks (``{}``
    for ``"auto"`` and transports that read nothing).

    Raises:
        ValueError: the environment holds an unusable value (the transport says which).
    """
    if name == "auto":
        return {}
    check(name)
    found = _REGISTRY[name].options
    return {} if found is None else dict(found(num_ranks))


def create(
    name: str,
    group: EPGroup,
    *,
    capacity: int,
    hidden: int,
    dtype: torch.dtype,
    heap: SymmetricHeap | None = None,
    options: Mapping[str, object] | None = None,
) -> Transport:
    """A new transport ``name`` with ``capacity`` receive rows of ``[hidden]`` ``dtype``;
    ``options``: from :func:`read_options` (default: read now)."""
    check(name)
    entry = _REGISTRY[name]
    if entry.needs_heap and heap is None:
        raise ValueError(f"transport {name!r} needs a symmetric heap, got none")
    if options is None:  # not given: read now (nothing for a transport without options)
        options = {} if entry.options is None else entry.options(group.size)
    extra = dict(options)
    return entry.factory(group, capacity=capacity, hidden=hidden, dtype=dtype, heap=heap, **extra)


# Each built-in transport under its plain name with its default rows (measured:
# docs/runtime.md, "Token rows or record rows"), the other rows as "<name>-<rows>".
DEFAULT_ROWS = MappingProxyType({"heap": "records", "a2a": "tokens"})


def builtin_name(base: str, rows: str) -> str:
    """The registered name of built-in transport ``base`` moving ``rows``."""
    return base if rows == DEFAULT_ROWS[base] else f"{base}-{rows}"


def _builtin(cls: Factory, name: str, *, on_heap: bool) -> Factory:
    """The factory of a built-in transport class registered as ``name`` (its ``name``);
    ``on_heap``: the class takes the symmetric heap after the group."""

    def make(group: EPGroup, *, heap: SymmetricHeap | None, **sizes: Any) -> Transport:
        place = (group, heap) if on_heap else (group,)
        args = (sizes.pop("capacity"), sizes.pop("hidden"), sizes.pop("dtype"))
        t = cls(*place, *args, **sizes)  # what remains: the transport's options
        t.name = name
        return t

    return make


def _register_builtins() -> None:
    classes = {"heap": (HeapTokenTransport, HeapTransport),
               "a2a": (AllToAllTokenTransport, AllToAllTransport)}  # fmt: skip
    for base, (tokens, records) in classes.items():
        for rows, cls in (("tokens", tokens), ("records", records)):
            name = builtin_name(base, rows)
            register(name, _builtin(cls, name, on_heap=base == "heap"), needs_heap=base == "heap")
    # hosts of LOCAL_WORLD_SIZE ranks (two_stage.py)
    two_stage = _builtin(TwoStageTokenTransport, "a2a-hosts", on_heap=False)
    register("a2a-hosts", two_stage, options=host_options)


_register_builtins()
