"""``moonplan.cli.args`` and ``cli.launch.run_and_announce``: the pieces every subcommand
shares (registration, the layer options and their checks, the launch banner)."""

from __future__ import annotations

import argparse

import pytest
import torch

from moonplan.cli.args import OneLineParser, add_layer_args, add_subcommand, check_layer_args
from moonplan.cli.launch import run_and_announce
from moonplan.cli.main import build_parser, main


def _handler(args: argparse.Namespace) -> int:
    return 7


def test_add_subcommand_sets_handler_help_and_description() -> None:
    parser = OneLineParser(prog="p")
    sub = parser.add_subparsers(dest="command", required=True)
    p = add_subcommand(sub, "x", _handler, "one line", "the long text")
    assert p.description == "the long text"
    assert "one line" in parser.format_help()
    args = parser.parse_args(["x"])
    assert args.func(args) == 7


def test_every_subcommand_has_a_handler() -> None:
    parser = build_parser()
    for name in ("demo", "plan", "cost", "profile", "simulate", "doctor"):
        args = parser.parse_args([name])
        assert callable(args.func), name


def test_layer_args_defaults_and_bounds() -> None:
    p = OneLineParser(prog="p")
    add_layer_args(p, experts_help="e", topk_help="k")
    a = p.parse_args([])
    assert (a.experts, a.tokens, a.topk, a.hidden, a.ffn) == (16, 256, 2, 64, 128)
    assert (a.sigma, a.seed, a.device, a.timeout) == (1.0, 0, "cpu", 300.0)
    with pytest.raises(SystemExit):
        p.parse_args(["--timeout", "0"])


def test_check_layer_args() -> None:
    check_layer_args("cpu", 2, 2)
    check_layer_args("cpu", 9, None)  # E comes from a trace
    with pytest.raises(ValueError, match="--topk 3 exceeds --experts 2"):
        check_layer_args("cpu", 3, 2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            check_layer_args("cuda", 1, 2)


@pytest.mark.parametrize("command", ["demo", "profile"])
def test_topk_above_experts_is_one_line_and_status_2(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--experts", "2", "--topk", "3"]) == 2
    err = capsys.readouterr().err
    assert err == f"moonplan {command}: error: --topk 3 exceeds --experts 2\n"


def _rank(rank: int, world: int, base: int) -> int:
    return base + rank


def test_run_and_announce_prints_the_banner_and_runs_every_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    got = run_and_announce(
        _rank, 2, 10, command="moonplan x", what="E=4 K=2", device="cpu", timeout=60.0
    )
    assert got == [10, 11]
    assert capsys.readouterr().out == "moonplan x: 2 ranks (gloo), E=4 K=2\n"
