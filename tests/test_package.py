"""``import moonplan`` gives every public submodule as an attribute (loaded lazily)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import moonplan


@pytest.mark.parametrize("name", sorted(moonplan.SUBMODULES))
def test_submodule_attribute(name: str) -> None:
    mod = getattr(moonplan, name)
    assert isinstance(mod, types.ModuleType) and mod.__name__ == moonplan.SUBMODULES[name]
    assert name in dir(moonplan)


def test_moved_modules_keep_their_public_names() -> None:
    from moonplan import checkpoint, profile, trace_recorder

    assert checkpoint.__name__ == "moonplan.adapters.checkpoint"
    assert callable(profile.profiling) and profile.__name__ == "moonplan.profiling.session"
    assert trace_recorder.TraceRecorder.__module__ == "moonplan.traces.recorder"


def test_unknown_attribute_raises() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        moonplan.no_such_thing  # noqa: B018


def test_submodules_load_lazily() -> None:
    code = (
        "import sys, moonplan; lazy = ['moonplan.simulate', 'moonplan.adapters.checkpoint'];"
        "assert not any(m in sys.modules for m in lazy), [m for m in lazy if m in sys.modules];"
        "moonplan.simulate.get_hardware; assert 'moonplan.simulate' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
