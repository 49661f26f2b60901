"""Argument checking shared by every ``moonplan`` subcommand: bad input is one line, exit 2.

* :class:`OneLineParser`: an ``ArgumentParser`` whose errors are a single line
  ``moonplan demo: error: argument --ranks: must be >= 1, got 0 (see --help)`` on
  stderr and exit status 2 (argparse's own status for bad arguments), instead of the
  usage block followed by the error;
* ``type=`` validators (:func:`int_range`, :func:`float_range`) that argparse turns into
  such errors;
* :func:`fail`: the same line from a handler, for checks that involve several
  arguments (e.g. ``--topk`` against ``--experts``);
* the options several subcommands share (:func:`add_ranks`, :func:`add_seed`,
  :func:`add_slots`, :func:`add_steps`, :func:`add_layer_args`): one flag, one type and
  one range everywhere, each subcommand giving its default and help.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any, NoReturn


class OneLineParser(argparse.ArgumentParser):
    """``ArgumentParser`` that reports a usage error on one line and exits with 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(prog: str, message: str) -> int:
    """Print ``{prog}: error: {message}`` (one line) to stderr; return 2 for the handler."""
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def add_subcommand(
    subparsers: Any,
    name: str,
    handler: Callable[[argparse.Namespace], int],
    summary: str,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` (``summary``: its line in ``moonplan --help``; ``description``:
    the top of its own ``--help``) whose ``args.func`` is ``handler``; returns its parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, help=summary, description=description
    )
    parser.set_defaults(func=handler)
    return parser


def add_ranks(
    p: argparse.ArgumentParser, *, default: int | None, help: str, most: int | None = None
) -> None:
    """``--ep`` (alias ``--ranks``, read as ``args.ranks``): the EP size, an integer in
    ``[1, most]`` (``most=None``: no upper bound)."""
    p.add_argument(
        "--ep", "--ranks", dest="ranks", type=int_range(1, most), default=default, help=help
    )


def add_seed(p: argparse.ArgumentParser, *, help: str) -> None:
    """``--seed``: an integer in ``[0, 2**31 - 1]`` (what every generator here accepts),
    default 0."""
    p.add_argument("--seed", type=int_range(0, 2**31 - 1), default=0, help=help)


def add_slots(p: argparse.ArgumentParser, *, help: str) -> None:
    """``--slots``: prefetch slots ``B`` per rank, an integer >= 0, default ``None``
    (the subcommand's own default, which ``help`` names)."""
    p.add_argument("--slots", type=int_range(0), default=None, help=help)


def add_steps(
    p: argparse.ArgumentParser, *, default: int, help: str, warmup: tuple[int, str] | None = None
) -> None:
    """``--steps`` (an integer >= 1) and, given ``warmup = (default, help)``, ``--warmup``
    (steps run first, an integer >= 0)."""
    p.add_argument("--steps", type=int_range(1), default=default, help=help)
    if warmup is not None:
        p.add_argument("--warmup", type=int_range(0), default=warmup[0], help=warmup[1])


def add_layer_args(
    parser: argparse.ArgumentParser,
    *,
    ranks_help: str,
    experts_help: str,
    topk_help: str,
    most_ranks: int | None = None,
) -> None:
    """The options ``demo`` and ``profile`` share: the EP size (:func:`add_ranks`, default
    ``None``: the launcher's or the subcommand's own), the layer shape and router skew
    (``--experts``, ``--tokens``, ``--topk``, ``--hidden``, ``--ffn``, ``--sigma``,
    ``--seed``) and where the ranks run (``--device``, ``--timeout``)."""
    p = parser
    add_ranks(p, default=None, help=ranks_help, most=most_ranks)
    p.add_argument("--experts", type=int_range(1), default=16, help=experts_help)
    p.add_argument("--tokens", type=int_range(0), default=256, help="tokens per rank (default 256)")
    p.add_argument("--topk", type=int_range(1), default=2, help=topk_help)
    p.add_argument("--hidden", type=int_range(1), default=64, help="hidden size H (default 64)")
    p.add_argument("--ffn", type=int_range(1), default=128, help="expert FFN size F (default 128)")
    p.add_argument(
        "--sigma",
        type=float_range(0),
        default=1.0,
        help="lognormal sigma of expert popularity (default 1)",
    )
    add_seed(p, help="seed (default 0)")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu (gloo) or cuda (nccl) (default cpu)",
    )
    p.add_argument(
        "--timeout",
        type=float_range(0, above=True),
        default=300.0,
        help="seconds before giving up (default 300)",
    )


def check_layer_args(device: str, topk: int, experts: int | None) -> None:
    """The checks every layer-running subcommand makes on its arguments.

    Raises:
        ValueError: ``device == "cuda"`` with no CUDA device visible, or ``topk`` above
            ``experts`` (``experts=None``: E comes from a trace, nothing to check).
    """
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA device; none is visible")
    if experts is not None and topk > experts:
        raise ValueError(f"--topk {topk} exceeds --experts {experts}")


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
