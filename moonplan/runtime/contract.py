"""What each rank contributes to a step, checked locally before the shared status exchange.

Legend: S tokens on this rank, H hidden, E experts, K top-k.

Every check returns an error message (``""`` when the input is fine) instead of
raising: the runtime carries the message in the step's first collective (the counts
all-gather, ``EPGroup.gather_with_status``), so every rank raises the same
``ContractError`` and nobody is left waiting in a later collective. Checked here:

* the tokens ``x``: a tensor of shape ``[S, H]`` (after flattening), of the layer's
  dtype, on the group's device;
* the router's output: a pair of torch tensors ``ids [S, K]`` (integers in
  ``[0, E)``) and ``weight [S, K]`` (finite floating point), on ``x``'s device;
* the layer's parameters: still the dtype and device its runtime buffers were built
  for (a moonplan layer does not follow ``.to(...)``: see :class:`FixedPlacement`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

CAST_FIRST = (
    "moonplan layers keep the dtype and device they were built with: cast or move the "
    "model before wrapping it (or build the layer with dtype=/on the group's device)"
)


def check_tokens(
    x: Any,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    dims: tuple[int, ...] | None = (2, 3),
) -> str:
    """Why ``x`` (``[T, H]`` or ``[B, T, H]``; any ``[..., H]`` with ``dims=None``) cannot be
    this rank's tokens, or ``""``."""
    if not isinstance(x, torch.Tensor):
        return f"expected x to be a torch.Tensor, got {_kind(x)}"
    bad_dim = x.dim() < 1 if dims is None else x.dim() not in dims
    if bad_dim or x.shape[-1] != hidden:
        return f"expected x of shape [T, {hidden}] or [B, T, {hidden}], got {tuple(x.shape)}"
    if x.dtype != dtype:
        return f"x is {x.dtype} but the layer runs in {dtype}; cast x to {dtype}"
    if not same_device(x.device, device):
        return f"x is on {x.device} but the layer runs on {device}; move x to {device}"
    return ""


def check_params(
    params: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> str:
    """Why the layer's parameters no longer match its runtime buffers, or ``""``."""
    for name, p in params.items():
        if p.dtype != dtype or not same_device(p.device, device):
            return (
                f"parameter {name} is {p.dtype} on {p.device} but the layer's buffers were "
                f"built for {dtype} on {device}; {CAST_FIRST}"
            )
    return ""


def call_router(
    route_fn: Callable[[torch.Tensor], Any], x_SH: torch.Tensor
) -> tuple[Any, Any, str]:
    """``(ids, weight, "")`` from ``route_fn(x_SH)``, or ``(None, None, why)`` if it raised
    or did not return a pair."""
    try:
        out = route_fn(x_SH)
    except Exception as exc:  # shared with every rank instead of leaving them waiting
        return None, None, f"router raised {type(exc).__name__}: {exc}"
    if not isinstance(out, tuple | list) or len(out) != 2:
        return None, None, f"router must return (topk_ids, topk_weight), got {_kind(out)}"
    return out[0], out[1], ""


def check_routing(ids_SK: Any, weight_SK: Any, S: int, E: int, K: int, device: torch.device) -> str:
    """Why ``(ids [S, K], weight [S, K])`` is not a valid routing on ``device``, or ``""``.

    Reads the ids' range and the weights' finiteness on the host (one sync).
    """
    if not isinstance(ids_SK, torch.Tensor) or not isinstance(weight_SK, torch.Tensor):
        return (
            f"router must return torch tensors (topk_ids, topk_weight), got "
            f"({_kind(ids_SK)}, {_kind(weight_SK)})"
        )
    if tuple(ids_SK.shape) != (S, K) or tuple(weight_SK.shape) != (S, K):
        got = f"ids {tuple(ids_SK.shape)} and weights {tuple(weight_SK.shape)}"
        return f"router returned {got}, expected {(S, K)} each"
    if ids_SK.dtype.is_floating_point or ids_SK.dtype.is_complex or ids_SK.dtype == torch.bool:
        return f"router returned expert ids of dtype {ids_SK.dtype}, expected integers"
    if not weight_SK.dtype.is_floating_point:
        return f"router returned route weights of dtype {weight_SK.dtype}, expected floating point"
    if not (same_device(ids_SK.device, device) and same_device(weight_SK.device, device)):
        devs = f"ids on {ids_SK.device} and weights on {weight_SK.device}"
        return f"router returned {devs}, expected both on {device}"
    bad_ids, bad_weights = torch.stack(
        [((ids_SK < 0) | (ids_SK >= E)).any(), ~torch.isfinite(weight_SK).all()]
    ).tolist()  # the one host read of a valid step
    if bad_ids:
        lo, hi = int(ids_SK.min()), int(ids_SK.max())
        return f"router returned expert ids outside [0, {E}): range [{lo}, {hi}]"
    if bad_weights:
        return "router returned non-finite (NaN or inf) route weights"
    return ""


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (``cuda`` without an index is the current one)."""
    return a.type == b.type and _index(a) == _index(b)


def _index(d: torch.device) -> int | None:
    if d.index is None and d.type == "cuda":
        return torch.cuda.current_device()
    return d.index


def _kind(v: Any) -> str:
    """``Tensor(shape)``, a builtin type's name, or ``module.Type`` (e.g. ``numpy.ndarray``)."""
    if isinstance(v, torch.Tensor):
        return f"Tensor{tuple(v.shape)}"
    t = type(v)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


class FixedPlacement(nn.Module):
    """Mixin: refuse ``.to(dtype/device)``, ``.half()``, ``.cuda()``... that would change the
    parameters' dtype or device away from the runtime's buffers.

    The runtime's symmetric heap and receive buffers are collective allocations of one
    dtype on one device; following a move would need every rank to rebuild them
    together, which a local ``.to()`` cannot arrange. Moves that change nothing (the
    same dtype and device, ``share_memory()``) pass. Subclasses set ``self.runtime``;
    before they do (``None``, declared here) every move passes.
    """

    runtime: Any = None

    def check_move(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Raise ``RuntimeError`` if the conversion ``fn`` (what ``Module._apply`` applies
        to every tensor) would change this layer's dtype or device."""
        rt = self.runtime
        if rt is None:
            return
        probe = fn(torch.empty(0, dtype=rt.dtype, device=rt.group.device))
        if probe.dtype != rt.dtype or not same_device(probe.device, rt.group.device):
            raise RuntimeError(
                f"{type(self).__name__} cannot move from {rt.dtype} on {rt.group.device} "
                f"to {probe.dtype} on {probe.device}: {CAST_FIRST}"
            )

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        self.check_move(fn)
        return super()._apply(fn, recurse)


class RefuseMoves:
    """A model's ``_apply`` that first asks every :class:`FixedPlacement` inside it, so a
    refused ``model.to(...)`` leaves the whole model as it was (without it, the modules
    before the first moonplan layer would already be converted). ``wrap_model`` installs
    it on the model instance (the class is untouched)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, fn: Any, recurse: bool = True) -> Any:
        for m in self.model.modules():
            if isinstance(m, FixedPlacement):
                m.check_move(fn)
        return type(self.model)._apply(self.model, fn, recurse)
