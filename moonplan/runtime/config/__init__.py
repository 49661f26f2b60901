"""A layer's configuration: ``MoEConfig``, a tree of four typed sections.

``moe_config`` (``MoEConfig``, what a layer resolves to, the agreed cost settings),
``sections`` (``Sizes``, ``Buffers``, ``Transfer``, ``Balancing``, the ``balance=``
modes and the runtime's calibration constants), ``table`` (the docs' option table).
"""

from moonplan.runtime.config.moe_config import OPTIONS, MoEConfig, Resolved, cost_settings
from moonplan.runtime.config.sections import (
    DEPRECATED,
    SECTIONS,
    Balancing,
    Buffers,
    Sizes,
    Transfer,
    balance_mode,
)

__all__ = [
    "DEPRECATED",
    "OPTIONS",
    "SECTIONS",
    "Balancing",
    "Buffers",
    "MoEConfig",
    "Resolved",
    "Sizes",
    "Transfer",
    "balance_mode",
    "cost_settings",
]
