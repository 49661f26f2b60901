"""Argument checking shared by every ``moonplan`` subcommand: bad input is one line, exit 2.

* :class:`OneLineParser`: an ``ArgumentParser`` whose errors are a single line
  ``moonplan demo: error: argument --ranks: must be >= 1, got 0 (see --help)`` on
  stderr and exit status 2 (argparse's own status for bad arguments), instead of the
  usage block followed by the error;
* ``type=`` validators (:func:`int_range`, :func:`float_range`) that argparse turns into
  such errors;
* :func:`fail`: the same line from a handler, for checks that involve several
  arguments (e.g. ``--topk`` against ``--experts``).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """``ArgumentParser`` that reports a usage error on one line and exits with 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(prog: str, message: str) -> int:
    """Print ``{prog}: error: {message}`` (one line) to stderr; return 2 for the handler."""
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """``type=`` for an integer in ``[lo, hi]`` (``hi=None``: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {_bounds(lo, hi)}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def float_range(
    lo: float, hi: float | None = None, *, above: bool = False
) -> Callable[[str], float]:
    """``type=`` for a finite number in ``[lo, hi]`` (``above``: strictly greater than ``lo``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = value > lo if above else value >= lo
        if not math.isfinite(value) or not low_ok or (hi is not None and value > hi):
            want = f"> {lo:g}" if above and hi is None else _bounds(lo, hi)
            raise argparse.ArgumentTypeError(f"must be a finite number {want}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def _bounds(lo: float, hi: float | None) -> str:
    return f">= {lo:g}" if hi is None else f"in [{lo:g}, {hi:g}]"
