"""``with_experts``: a copy of a wrapped module whose experts child is moonplan's.

Legend: none (modules only; ``home_experts`` is int64 ``[E_r]``, this rank's home experts).

The block adapters (:mod:`moonplan.adapters.block`, :mod:`moonplan.adapters.torchtitan`)
leave the module they wrap as it was and return a shallow copy of it whose experts child
is replaced.
"""

from __future__ import annotations

import copy

from torch import nn


def with_experts(module: nn.Module, name: str, child: nn.Module, experts: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` (same class and attributes, its own registries of
    children, parameters, buffers and hooks) whose child ``name`` is ``child``, sharing
    ``experts``' non-persistent ``home_experts`` buffer; ``module`` is left as it was."""
    new = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):
            new.__dict__[key] = copy.copy(value)
    setattr(new, name, child)
    new.register_buffer("home_experts", experts.get_buffer("home_experts"), persistent=False)
    return new
