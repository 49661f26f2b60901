"""Wrap existing MoE layers so that their experts run exactly balanced through moonplan.

* :func:`wrap`: one transformers (>= 5) MoE block, detected by structure.
* :func:`wrap_model`: every supported block of a model, in place.
* :func:`wrap_experts`: a hand-written layer (router function + SwiGLU expert weights).
* :func:`rehome_model`: move wrapped layers' home experts to new home orders.

See ``docs/wrapping.md`` for the supported structures, checkpoints and routing traces.
"""

from moonplan.adapters.block import wrap
from moonplan.adapters.detect import (
    BlockSpec,
    UnsupportedBlockError,
    inspect_block,
    is_supported,
)
from moonplan.adapters.generic import wrap_experts
from moonplan.adapters.model import (
    expert_parameter_names,
    moon_experts,
    rehome_model,
    wrap_model,
)
from moonplan.core.experts import MoonExperts
from moonplan.core.routed import RoutedExperts

__all__ = [
    "BlockSpec",
    "MoonExperts",
    "RoutedExperts",
    "UnsupportedBlockError",
    "expert_parameter_names",
    "inspect_block",
    "is_supported",
    "moon_experts",
    "rehome_model",
    "wrap",
    "wrap_experts",
    "wrap_model",
]
