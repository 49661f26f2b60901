"""``wrap_model``: wrap every supported MoE block of a model in place; ``rehome_model``:
move the wrapped layers' home experts to new home orders.

Legend: R ranks, E experts, E_r this rank's home experts.

Blocks are found by structure (:func:`~moonplan.adapters.detect.is_supported`) in
``named_modules`` order, which is the same on every rank, so the collective set-up of
each layer happens in the same order everywhere. Parameter names do not change: a
wrapped model's ``state_dict`` has the original keys, with expert tensors holding only
this rank's home experts (see :mod:`moonplan.adapters.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from moonplan.adapters.block import wrap
from moonplan.adapters.detect import (
    UnsupportedBlockError,
    inspect_block,
    is_supported,
    looks_like_moe,
)
from moonplan.adapters.torchtitan import is_torchtitan_moe
from moonplan.comm.group import EPGroup
from moonplan.core.experts import MoonExperts
from moonplan.core.sharded import ShardedExperts
from moonplan.runtime.config import MoEConfig
from moonplan.runtime.contract import RefuseMoves

M = TypeVar("M")


def wrap_model(
    model: nn.Module,
    *,
    group: EPGroup | object | None = None,
    config: MoEConfig | None = None,
    strict: bool = True,
    **options: Any,
) -> nn.Module:
    """Replace every supported MoE block of ``model`` by its wrapped form (in place).

    Collective: every rank calls it on an identical model (same structure, same weights,
    on the group's device and in its final dtype: wrap after ``.to(...)``). A later
    ``model.to(...)`` that would change a wrapped layer's dtype or device raises
    ``RuntimeError`` before converting anything.

    Args:
        model: e.g. a transformers ``MixtralForCausalLM``.
        group, config, **options: as for :func:`~moonplan.adapters.wrap`; one group and
            one config serve every layer (sizes left ``None`` are read per block).
            ``home_order`` may also be a mapping ``{block name: order}`` (the names
            ``model.named_modules()`` gives the MoE blocks): an order per layer, the
            blocks it does not name without one; a name that is no MoE block is an error.
        strict: raise if a module that looks like a MoE block (an ``experts`` child with
            parameters) is not supported, instead of leaving it unwrapped.

    Returns:
        ``model`` itself, its blocks replaced.

    Raises:
        UnsupportedBlockError: no supported block at all, or (``strict``) an
            unsupported MoE-like block (the message names it and says why).
    """
    if wrappable(model):
        raise UnsupportedBlockError(
            f"{type(model).__name__} is itself a MoE block: use moonplan.wrap(block)"
        )
    ep = group
    if group is not None and not isinstance(group, EPGroup):
        ep = EPGroup(group)  # one group object for every layer
    elif group is None and dist.is_available() and dist.is_initialized():
        ep = EPGroup(None)  # the default group (without it: one rank on the weights' device)
    targets, refused = _find_blocks(model, strict)
    if refused:
        raise UnsupportedBlockError("; ".join(refused) + " (pass strict=False to skip them)")
    if not targets:
        raise UnsupportedBlockError(
            f"no supported MoE block in {type(model).__name__}: expected modules with a "
            "router child and an `experts` child (gate_up_proj [E, 2F, H], down_proj [E, H, F]), "
            "or torchtitan MoE modules (router, routed_experts.inner_experts.w1_EFD ...)"
        )
    orders = _orders_by_block(options, targets)
    for name in targets:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        block = owner._modules[attr]
        assert block is not None
        per_block = options if orders is None else {**options, "home_order": orders.get(name)}
        setattr(owner, attr, wrap(block, group=ep, config=config, **per_block))
    model._apply = RefuseMoves(model)  # type: ignore[method-assign]  # .to() refused whole
    return model


def rehome_model(
    model: nn.Module,
    orders: Mapping[str, Sequence[int] | str] | str,
    *,
    optimizers: Sequence[torch.optim.Optimizer] | None = None,
) -> dict[str, int]:
    """Collective, between steps: re-home the layers named in ``orders`` (experts module
    name, as :func:`sharded_experts` and a recorded trace name them: a home order or
    ``"profile"``; or ``"profile"`` alone: every layer from its own recent loads) in
    module order; the experts that changed rank, per name
    (:meth:`~moonplan.core.sharded.ShardedExperts.rehome`: rows, gradients and the
    ``optimizers``' state move; ``optimizers`` required in training mode).

    Raises:
        ValueError: a name that is no sharded experts module (every rank alike: the
            model is the same on every rank); what ``rehome`` raises, per layer.
    """
    layers = dict(sharded_experts(model))
    if isinstance(orders, str):
        orders = dict.fromkeys(layers, orders)
    unknown = sorted(set(orders) - set(layers))
    if unknown:
        raise ValueError(f"orders name modules that hold no sharded experts: {unknown}; "
                         f"they are {sorted(layers)}")  # fmt: skip
    return {
        name: ex.rehome(orders[name], optimizers=optimizers)
        for name, ex in layers.items()
        if name in orders
    }


def _orders_by_block(
    options: dict[str, Any], targets: list[str]
) -> Mapping[str, Sequence[int]] | None:
    """``options["home_order"]`` where it is a mapping of block names (checked against
    ``targets``), else ``None`` (one order, or none, for every layer)."""
    orders = options.get("home_order")
    if not isinstance(orders, Mapping):
        return None
    unknown = sorted(set(orders) - set(targets))
    if unknown:
        raise ValueError(f"home_order names modules that are no MoE block: {unknown}; "
                         f"the blocks are {targets}")  # fmt: skip
    return orders


def _find_blocks(model: nn.Module, strict: bool) -> tuple[list[str], list[str]]:
    """Names of supported blocks (outermost first, none nested in another) and refusals."""
    targets: list[str] = []
    refused: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(t + ".") for t in targets):
            continue
        if wrappable(module):
            targets.append(name)
        elif strict and looks_like_moe(module) and not _wrapped(module):
            try:
                inspect_block(module)
            except UnsupportedBlockError as exc:
                refused.append(f"{name}: {exc}")
    return targets, refused


def wrappable(module: nn.Module) -> bool:
    """Whether :func:`~moonplan.adapters.wrap` takes ``module``: a supported block
    (:func:`~moonplan.adapters.detect.is_supported`) or a torchtitan ``MoE``."""
    return is_supported(module) or is_torchtitan_moe(module)


def _wrapped(module: nn.Module) -> bool:
    return isinstance(module._modules.get("experts"), MoonExperts)


def moon_experts(model: nn.Module) -> Iterator[tuple[str, MoonExperts]]:
    """``(qualified name, MoonExperts)`` of every wrapped layer of ``model``, in module order."""
    return _named(model, MoonExperts)


def sharded_experts(model: nn.Module) -> Iterator[tuple[str, ShardedExperts]]:
    """``(qualified name, module)`` of every module holding sharded expert tensors
    (:class:`~moonplan.core.sharded.ShardedExperts`: :class:`MoonExperts`, also inside
    a :class:`~moonplan.MoonMoE`, and torchtitan's ``MoonGroupedExperts``), in module order.
    Each has ``expert_tensors`` (its sharded parameter names), ``num_experts``,
    ``home_range``, ``group`` and ``weights_changed()``."""
    return _named(model, ShardedExperts)


def _named(model: nn.Module, kind: type[M]) -> Iterator[tuple[str, M]]:
    """``(qualified name, module)`` of ``model``'s modules of class ``kind``, in module order."""
    for name, module in model.named_modules():
        if isinstance(module, kind):
            yield name, module


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Names of the sharded expert parameters (``...experts.gate_up_proj``, ``...down_proj``;
    for torchtitan's MoE ``...routed_experts.inner_experts.w1_EFD``, ``w2_EDF``, ``w3_EFD``).

    Every other parameter is replicated and gets local gradients: all-reduce those over
    data-parallel ranks, never these (e.g. pass them to DDP's
    ``_set_params_and_buffers_to_ignore_for_model``, or give them their own optimizer group).
    """
    names = []
    for name, ex in sharded_experts(model):
        prefix = f"{name}." if name else ""
        names += [prefix + p for p, _ in ex.named_parameters(recurse=False)]
    return names
