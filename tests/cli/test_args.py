"""``moonplan.cli.args`` and ``cli.launch.run_and_announce``: the pieces every subcommand
shares (registration, the layer options and their checks, the launch banner)."""

from __future__ import annotations

import argparse

import pytest
import torch

from moonplan.cli.args import (
    OneLineParser,
    add_layer_args,
    add_ranks,
    add_seed,
    add_slots,
    add_steps,
    add_subcommand,
    check_layer_args,
)
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
    add_layer_args(p, ranks_help="r", experts_help="e", topk_help="k")
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


def test_shared_options_parse_the_same_everywhere() -> None:
    p = OneLineParser(prog="p")
    add_ranks(p, default=None, help="r", most=4)
    add_seed(p, help="s")
    add_slots(p, help="b")
    add_steps(p, default=3, help="t", warmup=(1, "w"))
    a = p.parse_args([])
    assert (a.ranks, a.seed, a.slots, a.steps, a.warmup) == (None, 0, None, 3, 1)
    a = p.parse_args(["--ranks", "4", "--seed", "7", "--slots", "0", "--steps", "1"])
    assert (a.ranks, a.seed, a.slots, a.steps) == (4, 7, 0, 1)
    assert p.parse_args(["--ep", "2"]).ranks == 2
    for bad in (["--ep", "5"], ["--ep", "0"], ["--seed", "-1"], ["--seed", str(2**31)]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    for bad in (["--slots", "-1"], ["--steps", "0"], ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    no_warmup = OneLineParser(prog="q")
    add_steps(no_warmup, default=2, help="t")
    assert "warmup" not in vars(no_warmup.parse_args([]))
