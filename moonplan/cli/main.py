"""The ``moonplan`` command: ``demo``, ``plan``, ``cost``, ``profile``, ``simulate`` and
``doctor``.

Every subcommand names the EP size ``--ep`` (``--ranks`` is an alias); ``--version``
prints the version; model and hardware presets are case-insensitive; bad arguments print
one line on stderr and exit with status 2.

Building the parser imports no torch (the subcommand modules import it inside their
handlers; the names they offer come from :mod:`moonplan.cli.choices`), so ``--help``
answers in well under a second.
"""

from __future__ import annotations

import argparse
import sys

from moonplan import __version__
from moonplan.cli import cost, demo, doctor, plan, profile, simulate
from moonplan.cli.args import OneLineParser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = OneLineParser(
        prog="moonplan",
        description="Exactly balanced MoE expert parallelism: demo, planner, cost calculator, "
        "profiler and simulator.",
    )
    parser.add_argument("--version", action="version", version=f"moonplan {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo.register(sub)
    plan.register(sub)
    cost.register(sub)
    profile.register(sub)
    simulate.register(sub)
    doctor.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
