"""``moonplan --help`` and every subcommand's: each option explained, fast to print.

Legend: none.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import pytest

from moonplan.cli.main import build_parser

COMMANDS = ("demo", "plan", "cost", "profile", "simulate", "doctor")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_command_is_listed() -> None:
    assert set(_subparsers()) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_and_its_default(command: str) -> None:
    """Each option has help text; one whose default is a value (not off, not none) names
    it; choices appear in the help line (argparse prints ``{a,b}``)."""
    parser = _subparsers()[command]
    assert parser.description, f"{command} has no description"
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{command} {name}: no help"
        quiet = action.default in (None, False, [], argparse.SUPPRESS)
        if not quiet:
            assert "default" in action.help, f"{command} {name}: default not said"
        if action.choices is not None:
            assert all(str(c) in parser.format_help() for c in action.choices)


def test_console_help_is_fast() -> None:
    """Best of 3 runs of ``python -m moonplan.cli simulate --help`` (the command with the
    most options) stays under 1 s. (That the parser imports no torch is
    ``tests/test_package.py::test_import_moonplan_imports_no_torch``.)"""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "moonplan.cli", "simulate", "--help"],
            check=True,
            capture_output=True,
        )
        best = min(best, time.perf_counter() - t0)
    assert best < 1.0, best
