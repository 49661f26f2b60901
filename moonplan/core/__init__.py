"""The core layers: ``MoonMoE`` and the experts module every adapter builds on.

* :class:`MoonMoE` (``core/moe.py``): a router, :class:`MoonExperts` and optional
  shared experts.
* :class:`MoonExperts` (``core/experts.py``): this rank's home experts, run exactly
  balanced; the drop-in for a transformers experts module.
* :class:`RoutedExperts` (``core/routed.py``): any router function in front of
  :class:`MoonExperts` (what ``moonplan.adapters.wrap_experts`` returns).
* :class:`ShardedExperts`, :class:`RuntimeViews` (``core/sharded.py``): what every
  experts module shares (the group, config, home experts and ``LayerRuntime``).

The adapters (``moonplan.adapters``) import these; nothing here imports an adapter.
"""

from moonplan.core.experts import MoonExperts
from moonplan.core.moe import MoonMoE
from moonplan.core.routed import RoutedExperts, routed_forward
from moonplan.core.sharded import RuntimeViews, ShardedExperts

__all__ = [
    "MoonExperts",
    "MoonMoE",
    "RoutedExperts",
    "RuntimeViews",
    "ShardedExperts",
    "routed_forward",
]
