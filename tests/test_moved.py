"""Names whose module moved stay loadable from the old path, with a DeprecationWarning.

Legend: none (no tensors).
"""

from __future__ import annotations

import importlib

import pytest

import moonplan
from moonplan.moved import moved_names

MOVED = [  # (old module, name, where it lives now)
    ("moonplan.layer", "MoonMoE", "moonplan.core.moe"),
    ("moonplan.adapters.experts", "MoonExperts", "moonplan.core.experts"),
    ("moonplan.adapters.sharded", "ShardedExperts", "moonplan.core.sharded"),
    ("moonplan.adapters.sharded", "RuntimeViews", "moonplan.core.sharded"),
    ("moonplan.adapters.sharded", "resolve_group", "moonplan.core.sharded"),
    ("moonplan.adapters.sharded", "with_experts", "moonplan.adapters.swap"),
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_a_moved_name_loads_from_its_old_module_with_a_warning(
    old: str, name: str, new: str
) -> None:
    module = importlib.import_module(old)
    for _ in range(2):  # every access warns, not only the first import
        with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {new}\.{name}"):
            got = getattr(module, name)
        assert got is getattr(importlib.import_module(new), name)


def test_from_import_of_a_moved_name_warns() -> None:
    with pytest.warns(DeprecationWarning, match="moonplan.layer.MoonMoE moved"):
        from moonplan.layer import MoonMoE
    assert MoonMoE is moonplan.MoonMoE


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_the_public_paths_do_not_warn() -> None:
    from moonplan.adapters import MoonExperts, RoutedExperts
    from moonplan.core import MoonMoE as Core

    assert moonplan.MoonMoE is Core and MoonExperts.__module__ == "moonplan.core.experts"
    assert RoutedExperts.__module__ == "moonplan.core.routed"


def test_an_unknown_name_of_a_moved_module_raises() -> None:
    import types

    getter = moved_names("old.place", {"Here": types.ModuleType("new.place")})
    with pytest.raises(AttributeError, match=r"'old\.place' has no attribute 'Nope'"):
        getter("Nope")
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        importlib.import_module("moonplan.layer").Nope  # noqa: B018
