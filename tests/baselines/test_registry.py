"""The policy registry: built-in registrations, and a toy policy registered in a test that the
simulator's tables, plots, planning-time defaults and CLI pick up with no other file touched."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
import torch

from moonplan.baselines import POLICY_NAMES
from moonplan.baselines.planner_time import auto_us, exact_us
from moonplan.baselines.policy_base import Policy, PolicyStep, make_step
from moonplan.baselines.registry import PolicyInfo, info, make_policy, names, register, registered
from moonplan.cli import simulate as cli_simulate
from moonplan.simulate.model_time import SimConfig, default_plan_us
from moonplan.simulate.models import get_model
from moonplan.simulate.report import detail_table, sweep_table
from moonplan.simulate.sweep import SweepSpec, simulate_trace
from moonplan.simulate.workload import drifting_counts
from moonplan.stepcost import get_hardware


class OneRankPolicy(Policy):
    """Toy: every record runs on rank ``rank``, one planner run per step."""

    name = "toy-one-rank"

    def __init__(self, num_ranks: int, num_experts: int, *, rank: int = 0) -> None:
        super().__init__(num_ranks, num_experts)
        self.rank = rank

    def step(self, counts: Any) -> PolicyStep:
        counts_RE = self._counts(counts)
        alloc_ER = torch.zeros(self.num_experts, self.num_ranks, dtype=torch.int64)
        alloc_ER[:, self.rank] = counts_RE.sum(0)
        return make_step(self.name, counts_RE, alloc_ER)


TOY = PolicyInfo(
    "toy-one-rank",
    lambda name, R, E, **options: OneRankPolicy(R, E, **options),
    label="TOY",
    style=(":", "x"),
    plan_us=7.0,
    options=("rank",),
)


def test_builtin_registrations_keep_the_old_tables() -> None:
    assert POLICY_NAMES == names() == (
        "static-linear", "static-round-robin", "capacity-1.0", "capacity-1.25", "eplb",
        "eplb-fast", "moonep-greedy", "moonplan", "moonplan-resident", "moonplan-auto",
    )  # fmt: skip
    labels = [info(n).header(n) for n in names()]
    assert labels == ["static", "rr", "cap1.0", "cap1.25", "eplb", "eplb-fast", "greedy",
                      "moonplan", "resident", "auto"]  # fmt: skip
    assert info("capacity-3").header("capacity-3") == "capacity-3"  # a family member
    # the MoonEP greedy's published 51 us; moonplan's kernel by shape (baselines.planner_time)
    assert default_plan_us() == {
        "moonep-greedy": 51.0, "moonplan": exact_us, "moonplan-resident": exact_us,
        "moonplan-auto": auto_us, "moonplan-auto-ordered": auto_us,
    }  # fmt: skip
    assert info("moonplan-auto-ordered").header("moonplan-auto-ordered") == "auto+order"
    assert "moonplan-refresh" not in set(names())  # gone: auto refills in the background
    assert info("moonep-greedy").style == ("--", "s") and info("eplb").style == ("-", ".")


def test_registry_refuses_duplicates_and_names_the_choices() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register(PolicyInfo("eplb", TOY.build))
    assert isinstance(make_policy("eplb", 4, 8), Policy)  # the built-in one survived
    with pytest.raises(ValueError, match=r"unknown policy 'lpt'.*moonplan-auto.*capacity-"):
        info("lpt")
    with pytest.raises(ValueError, match="needs a name"):
        register(PolicyInfo("", TOY.build))


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moonplan")
    cli_simulate.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *argv])
    return int(args.func(args))


def test_a_toy_policy_registered_in_a_test_reaches_the_simulator(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model, hw = get_model("mixtral-8x7b"), get_hardware("h200-node")
    counts = drifting_counts(4, model.num_experts, 64, model.top_k, sigma=1.0, steps=3, seed=1)
    with registered(TOY):
        assert names()[-1] == "toy-one-rank" and SweepSpec().policies == names()
        toy = make_policy("toy-one-rank", 4, 8, rank=2, period=3, cost=None)  # others dropped
        assert toy.step(counts[0]).load_R.tolist()[2] == int(counts[0].sum())
        cfg = SimConfig()
        assert cfg.plan_us["toy-one-rank"] == 7.0
        rows = simulate_trace(counts, model, hw, cfg, ["static-linear", "toy-one-rank"], warmup=1)
        row = {r["policy"]: r for r in rows}["toy-one-rank"]
        assert row["plan_us"] == pytest.approx(7.0)  # its registered planning time
        assert row["balancedness"] == pytest.approx(0.25)  # all on one of 4 ranks
        table = sweep_table([{**r, "sigma": 1.0} for r in rows])
        assert "TOY" in table.splitlines()[0] and "toy-one-rank" in detail_table(rows)
        argv = ["--model", "mixtral-8x7b", "--ep", "2", "--tokens", "32", "--steps", "1",
                "--warmup", "1", "--no-progress", "--sigma", "1", "--json"]  # fmt: skip
        assert run_cli([*argv, "--policies", "static-linear,toy-one-rank"]) == 0
        got = json.loads(capsys.readouterr().out)["rows"]
        assert [r["policy"] for r in got] == ["static-linear", "toy-one-rank"]
    assert "toy-one-rank" not in names() and "toy-one-rank" not in SimConfig().plan_us
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("toy-one-rank", 4, 8)


def test_a_toy_policy_registered_in_a_test_is_drawn_in_its_style() -> None:
    pytest.importorskip("matplotlib")
    from moonplan.simulate import plots

    model, hw = get_model("mixtral-8x7b"), get_hardware("h200-node")
    with registered(TOY):
        rows = [
            {**r, "sigma": sigma}
            for sigma in (0.5, 1.0)
            for r in simulate_trace(
                drifting_counts(2, model.num_experts, 32, model.top_k, sigma=sigma, steps=2),
                model, hw, SimConfig(), ["moonplan", "toy-one-rank"], warmup=1,
            )
        ]  # fmt: skip
        fig = plots.figure_vs_skew(rows)
    lines = {x.get_label(): x for x in fig.axes[0].get_lines()}
    plots.require_matplotlib().close(fig)
    # the legend names a policy by its table label
    assert (lines["TOY"].get_linestyle(), lines["TOY"].get_marker()) == (":", "x")
    assert (lines["moonplan"].get_linestyle(), lines["moonplan"].get_marker()) == ("-", "o")


def test_every_module_of_the_package_is_imported_so_its_policies_are_registered() -> None:
    import pkgutil
    import sys

    import moonplan.baselines as package

    modules = {f"moonplan.baselines.{m.name}" for m in pkgutil.iter_modules(package.__path__)}
    assert {"moonplan.baselines.eplb", "moonplan.baselines.static_ep"} <= modules
    assert modules <= set(sys.modules)
    builders = {info(n).build.__module__ for n in names()}
    assert builders <= modules  # every built-in registers from its own module in the package
