"""Deprecated module path: ``MoonExperts`` lives in :mod:`moonplan.core.experts`.

Legend: none. Import it as ``moonplan.adapters.MoonExperts`` or
``moonplan.core.MoonExperts``; ``moonplan.adapters.experts.MoonExperts`` still works,
with a ``DeprecationWarning``.
"""

from moonplan.core import experts
from moonplan.moved import moved_names

__getattr__ = moved_names(__name__, {"MoonExperts": experts})
