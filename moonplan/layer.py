"""Deprecated module path: ``MoonMoE`` lives in :mod:`moonplan.core.moe`.

Legend: none. Import it as ``moonplan.MoonMoE`` or ``moonplan.core.MoonMoE``;
``moonplan.layer.MoonMoE`` still works, with a ``DeprecationWarning``.
"""

from moonplan.core import moe
from moonplan.moved import moved_names

__getattr__ = moved_names(__name__, {"MoonMoE": moe})
