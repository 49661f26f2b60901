"""``import moonplan`` gives every public submodule as an attribute (loaded lazily)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import moonplan


@pytest.mark.parametrize("name", moonplan.SUBMODULES)
def test_submodule_attribute(name: str) -> None:
    mod = getattr(moonplan, name)
    assert isinstance(mod, types.ModuleType) and mod.__name__ == f"moonplan.{name}"
    assert name in dir(moonplan)


def test_unknown_attribute_raises() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        moonplan.no_such_thing  # noqa: B018


def test_submodules_load_lazily() -> None:
    code = (
        "import sys, moonplan; lazy = ['moonplan.simulate', 'moonplan.checkpoint'];"
        "assert not any(m in sys.modules for m in lazy), [m for m in lazy if m in sys.modules];"
        "moonplan.simulate.get_hardware; assert 'moonplan.simulate' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
