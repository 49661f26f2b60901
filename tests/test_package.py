"""``import moonplan`` gives every public submodule as an attribute (loaded lazily)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest
import torch

import moonplan


@pytest.mark.parametrize("name", sorted(moonplan.SUBMODULES))
def test_submodule_attribute(name: str) -> None:
    mod = getattr(moonplan, name)
    assert isinstance(mod, types.ModuleType) and mod.__name__ == moonplan.SUBMODULES[name]
    assert name in dir(moonplan)


def test_moved_modules_keep_their_public_names() -> None:
    from moonplan import checkpoint, trace_recorder

    assert checkpoint.__name__ == "moonplan.adapters.checkpoint"
    assert trace_recorder.TraceRecorder.__module__ == "moonplan.traces.recorder"


def test_profile_is_the_profiling_context_manager() -> None:
    """``moonplan.profile(layer)`` is the obvious call: the profiler's context manager."""
    from moonplan.profiling.session import profiling

    assert moonplan.profile is profiling
    with (
        pytest.raises(ValueError, match="found no MoonMoE layer"),
        moonplan.profile(torch.nn.Linear(2, 2)),
    ):
        pass


@pytest.mark.parametrize("name", sorted(moonplan.NAMES))
def test_public_names_load_from_their_modules(name: str) -> None:
    assert name in moonplan.__all__ and name in dir(moonplan)
    got = getattr(moonplan, name)
    assert got is getattr(importlib.import_module(moonplan.NAMES[name]), name)


def test_all_is_exactly_the_public_names() -> None:
    assert sorted(moonplan.__all__) == sorted(moonplan.NAMES)


def test_plan_stays_the_function_after_its_package_loads() -> None:
    """Loading a subpackage binds it on its parent (``setattr(moonplan, "plan", <package
    moonplan.plan>)``, what the import system does when ``moonplan.plan.api`` is the first
    module to load it): that binding must not replace the function ``moonplan.plan``."""
    package = importlib.import_module("moonplan.plan")
    setattr(moonplan, "plan", package)  # noqa: B010 (the import system's own call)
    assert callable(moonplan.plan) and moonplan.plan is package.plan
    assert moonplan.plan(torch.tensor([[3, 1], [0, 0]])).alloc.sum(0).tolist() == [2, 2]
    setattr(moonplan, "errors", sys.modules["moonplan.errors"])  # noqa: B010 (not a NAMES entry)
    assert moonplan.errors is sys.modules["moonplan.errors"]


def test_import_moonplan_imports_no_torch() -> None:
    """``import moonplan`` and building the command's parser stay light (``--help`` in
    well under a second): torch loads only when a command or a public name needs it."""
    code = (
        "import sys, moonplan; from moonplan.cli.main import build_parser; build_parser();"
        "heavy = [m for m in ('torch', 'numpy') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_attribute_raises() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        moonplan.no_such_thing  # noqa: B018


@pytest.mark.slow  # a fresh interpreter imports torch (2.5-6 s)
def test_submodules_load_lazily() -> None:
    code = (
        "import sys, moonplan; lazy = ['moonplan.simulate', 'moonplan.adapters.checkpoint'];"
        "assert not any(m in sys.modules for m in lazy), [m for m in lazy if m in sys.modules];"
        "moonplan.simulate.get_hardware; assert 'moonplan.simulate' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
