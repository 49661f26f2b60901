"""Deprecated module path: the shared experts front end lives in :mod:`moonplan.core.sharded`,
``with_experts`` in :mod:`moonplan.adapters.swap`.

Legend: none. ``moonplan.adapters.sharded.ShardedExperts`` (and the other names below)
still work, with a ``DeprecationWarning``; import them from ``moonplan.core``.
"""

from moonplan.adapters import swap
from moonplan.core import sharded
from moonplan.moved import moved_names

_CORE = (
    "RuntimeViews",
    "ShardedExperts",
    "agreed_construction",
    "home_parameter",
    "options_config",
    "register_home",
    "resolve_group",
)
__getattr__ = moved_names(__name__, {name: sharded for name in _CORE} | {"with_experts": swap})
