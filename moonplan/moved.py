"""Module paths that moved: their names stay loadable from the old place, with a warning.

Legend: none (no tensors).

A module that moved leaves a small module at its old path whose ``__getattr__`` is
:func:`moved_names`: each access of a moved name (``from moonplan.layer import MoonMoE``,
``moonplan.layer.MoonMoE``) warns with a ``DeprecationWarning`` naming the new place and
returns the object itself, so old code keeps working unchanged for one release.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any


def moved_names(old: str, new: Mapping[str, ModuleType]) -> Callable[[str], Any]:
    """The ``__getattr__`` of the deprecated module ``old`` (its dotted name), whose names
    now live in ``new`` (name -> the module that defines it).

    Raises (from the returned function):
        AttributeError: a name that is not one of ``new``'s.
    """

    def __getattr__(name: str) -> Any:
        home = new.get(name)
        if home is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} moved to {home.__name__}.{name}; import it from there "
            f"(the module {old} goes in a later release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return home.__dict__[name]

    return __getattr__
