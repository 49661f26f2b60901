"""``moonplan simulate --dispatch``: the scheme reaches every policy; refused without tokens."""

from __future__ import annotations

import argparse
import json

import pytest

from moonplan.cli import simulate as cli_simulate


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli_simulate.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *argv])
    return int(args.func(args))


def test_dispatch_rank_moves_fewer_rows(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--ep", "8", "--sigma", "1", "--steps", "1", "--warmup", "0", "--tokens", "64"]
    base += ["--policies", "static-linear,moonplan", "--json", "--no-progress"]
    got = {}
    for scheme in ("record", "rank", "host"):
        assert _run([*base, "--dispatch", scheme]) == 0
        got[scheme] = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for policy in ("static-linear", "moonplan"):
        assert got["rank"][policy]["dispatch_us"] < got["record"][policy]["dispatch_us"]
        # one host: "host" is "rank"
        assert got["host"][policy]["total_us"] == got["rank"][policy]["total_us"]


@pytest.mark.parametrize("extra", [["--trends"], ["--counts", "trace.npy"]])
def test_dispatch_needs_sampled_tokens(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(["--dispatch", "rank", "--no-progress", *extra]) == 2
    assert "samples tokens" in capsys.readouterr().err


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(SystemExit):
        _run(["--dispatch", "token"])
