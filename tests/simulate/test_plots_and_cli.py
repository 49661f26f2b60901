"""Plots (when matplotlib is installed) and the ``simulate`` subcommand."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from moonplan.baselines.registry import make_policy
from moonplan.cli import simulate as cli_simulate
from moonplan.simulate.sweep import SweepSpec, sweep
from moonplan.traces import generate_counts


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moonplan")
    cli_simulate.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *argv])
    return int(args.func(args))


TINY = ["--model", "mixtral-8x7b", "--ep", "2,4", "--tokens", "32", "--steps", "1",
        "--warmup", "1", "--no-progress"]  # fmt: skip


def test_plots_write_small_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from moonplan.simulate import plots

    counts = generate_counts("lognormal", ranks=4, experts=8, tokens=64, topk=2, sigma=1.0)
    steps = [make_policy(n, 4, 8).step(counts) for n in ("static-linear", "moonplan")]
    spec = SweepSpec(model="mixtral-8x7b", ranks=(2, 4), sigmas=(0.0, 1.0), tokens=32, steps=1,
                     warmup=1, policies=("static-linear", "moonplan"))  # fmt: skip
    rows = sweep(spec)
    one_skew = [r for r in rows if r["sigma"] == 0.0]
    paths = [
        plots.plot_rank_loads(steps, tmp_path / "loads.png"),
        plots.plot_balancedness({"static": [0.5, 0.6], "moonplan": [1, 1]}, tmp_path / "b.png"),
        plots.plot_sweep(rows, tmp_path / "skew.png"),
        plots.plot_sweep(one_skew, tmp_path / "ep.png"),
    ]
    for p in paths:
        assert p.exists() and 0 < p.stat().st_size < 200_000
    with pytest.raises(ValueError):
        plots.plot_sweep([], tmp_path / "none.png")


def test_plots_explain_a_missing_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    from moonplan.simulate import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        plots.require_matplotlib()


def test_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert run([*TINY, "--sigma", "0,1"]) == 0
    out = capsys.readouterr().out
    assert "force-balanced ideal" in out and "resident" in out
    assert run([*TINY, "--sigma", "1", "--json", "--policies", "static-linear,moonplan"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["policy"] for r in rows] == ["static-linear", "moonplan"] * 2


def test_cli_serial_prefetch_shows_the_old_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*TINY, "--ep", "4", "--tokens", "2048", "--sigma", "2", "--json",
            "--policies", "static-linear,moonep-greedy,moonplan,moonplan-auto"]  # fmt: skip
    assert run(argv) == 0
    over = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert run([*argv, "--serial-prefetch"]) == 0
    serial = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert serial["static-linear"]["total_us"] == over["static-linear"]["total_us"]
    for name in ("moonep-greedy", "moonplan"):  # they copy: the serial schedule exposes it all
        assert serial[name]["prefetch_us"] > 0
        assert serial[name]["prefetch_exposed_us"] == pytest.approx(serial[name]["prefetch_us"])
        assert serial[name]["total_us"] > over[name]["total_us"]
        assert over[name]["prefetch_exposed_us"] < over[name]["prefetch_us"]
    assert "choices" in serial["moonplan-auto"] and "choices" in over["moonplan-auto"]


def test_cli_recorded_counts_plot_and_detail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    trace = np.stack([generate_counts("lognormal", ranks=2, experts=8, tokens=32, topk=2,
                                      seed=s).numpy() for s in range(3)])  # fmt: skip
    np.save(tmp_path / "t.npy", trace)
    png = tmp_path / "p.png"
    argv = ["--counts", str(tmp_path / "t.npy"), "--model", "mixtral-8x7b", "--detail"]
    assert run([*argv, "--no-progress", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "moonplan-resident" in out and png.exists()
    assert "recorded" in out and "nan" not in out  # the skew column of a recorded trace
    assert run([*argv, "--no-progress", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]  # strict JSON: no NaN
    assert all(r["sigma"] is None for r in rows)


def test_cli_break_even_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*TINY, "--ep", "2", "--sigma", "1", "--break-even", "--tokens-grid", "32,4096"]
    assert run(argv) == 0
    out = capsys.readouterr().out
    assert "break-even" in out and "auto S*" in out
    assert run([*TINY, "--model", "nope"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert run([*TINY, "--policies", "lpt"]) == 2
    assert run([*TINY, "--plan-us", "moonplan"]) == 2
    assert run([*TINY, "--policies", ","]) == 2
    capsys.readouterr()


@pytest.mark.parametrize("mode", ["--trends", "--break-even"])
def test_cli_plot_refused_where_there_is_nothing_to_draw(
    mode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "x.png"
    assert run([*TINY, mode, "--plot", str(png)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"not {mode}" in err[0] and not png.exists()


def test_sweep_plots_have_labelled_ticks_and_units() -> None:
    pytest.importorskip("matplotlib")
    from moonplan.simulate import plots

    spec = SweepSpec(model="mixtral-8x7b", ranks=(2, 4), sigmas=(0.0, 0.5, 1.0), tokens=32,
                     steps=1, warmup=1, policies=("static-linear", "moonplan"))  # fmt: skip
    rows = sweep(spec)
    fig = plots.figure_vs_skew(rows)
    fig.canvas.draw()
    ax = fig.axes[0]
    ys = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert len(ys) >= 3 and all(y.endswith("x") for y in ys), ys
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "0.5", "1"]
    assert "(x)" in ax.get_ylabel()
    fig = plots.figure_vs_ep([r for r in rows if r["sigma"] == 1.0])
    fig.canvas.draw()
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["2", "4"]
    assert "ranks" in fig.axes[0].get_xlabel()


def test_cli_progress_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a for a in TINY if a != "--no-progress"]
    assert run([*argv, "--sigma", "0", "--policies", "static-linear"]) == 0
    captured = capsys.readouterr()
    assert "ETA" in captured.err and "done" in captured.err and "ETA" not in captured.out


def _ratio_rows(low: float, high: float) -> list[dict]:
    """Two policies on two EP sizes and three skews; one point at ``low``, one at ``high``."""
    rows = []
    for R in (8, 64):
        for sigma in (0.0, 1.0, 2.0):
            for name in ("static-linear", "moonplan-resident"):
                ratio = 1.0 + sigma
                if (R, name) == (64, "moonplan-resident"):
                    ratio = low if sigma == 0.0 else 1.2
                if (R, name, sigma) == (64, "static-linear", 2.0):
                    ratio = high
                rows.append({"policy": name, "ranks": R, "sigma": sigma, "rel_ideal": ratio})
    return [{**r, "maxvio_target": None} for r in rows]


@pytest.mark.parametrize(("low", "high"), [(0.65, 36.0), (0.65, 4.0), (0.3, 200.0), (0.89, 3.0)])
def test_points_below_the_usual_bottom_stay_inside_the_axis(low: float, high: float) -> None:
    """A ratio below 0.9x (a policy faster than the ideal's model) is drawn, on the log
    axis as on the linear one: no plotted point lies outside the limits."""
    pytest.importorskip("matplotlib")
    from moonplan.simulate import plots

    rows = _ratio_rows(low, high)
    for fig in (plots.figure_vs_skew(rows), plots.figure_vs_ep(rows)):
        fig.canvas.draw()
        ys = [float(y) for ax in fig.axes for line in ax.get_lines() for y in line.get_ydata()]
        assert low in ys and high in ys
        for ax in fig.axes:  # each panel its own ratio axis, from its own points
            mine = [float(y) for line in ax.get_lines()[:2] for y in line.get_ydata()]
            bottom, top = ax.get_ylim()
            assert ax.get_yscale() == ("log" if max(mine) > plots.LOG_ABOVE else "linear")
            assert all(bottom < y < top for y in mine), (bottom, top, min(mine), max(mine))
        plots.require_matplotlib().close(fig)


def test_each_ep_size_gets_its_own_ratio_axis() -> None:
    """A 1.02x gap at EP 8 stays visible beside 20x at EP 64: the EP 8 panel spans a few
    tenths, not the other panel's range; the legend uses the tables' labels."""
    pytest.importorskip("matplotlib")
    from moonplan.simulate import plots

    rows = [
        {
            "policy": p,
            "ranks": R,
            "sigma": s,
            "maxvio_target": None,
            "rel_ideal": (1.0 if p == "static-linear" else 1.02) * (20.0 if R == 64 else 1.0),
        }
        for R in (8, 64)
        for s in (0.0, 1.0)
        for p in ("static-linear", "moonplan-resident")
    ]
    fig = plots.figure_vs_skew(rows)
    fig.canvas.draw()
    low, high = fig.axes[0].get_ylim()
    assert high - low < 0.5 and fig.axes[1].get_ylim()[1] > 20
    labels = {t.get_text() for t in fig.axes[-1].get_legend().get_texts()}
    assert labels == {"static", "resident"}
    plots.require_matplotlib().close(fig)


def test_ratio_limits_keep_the_usual_bottom_when_nothing_is_below_it() -> None:
    from moonplan.simulate.plots import ratio_limits

    assert ratio_limits([1.0, 2.0])[0] == 0.9 and ratio_limits([1.0, 20.0])[:1] == (0.9,)
    assert ratio_limits([0.65, 20.0])[0] == 0.5  # the next labelled log tick below
    low, high, log = ratio_limits([0.5, 3.0], bottom=0.0)  # bars start at zero
    assert (low, log) == (0.0, False) and high > 3.0


def test_legends_cover_no_data(tmp_path: Path) -> None:
    """Every figure's legend lies outside all of its axes."""
    pytest.importorskip("matplotlib")
    from moonplan.simulate import plots

    counts = generate_counts("lognormal", ranks=4, experts=8, tokens=64, topk=2, sigma=1.0)
    steps = [make_policy(n, 4, 8).step(counts) for n in ("static-linear", "moonplan")]
    plt = plots.require_matplotlib()
    rows = _ratio_rows(0.65, 36.0)
    figs = [plots.figure_vs_skew(rows), plots.figure_vs_ep(rows)]
    for fig in figs:
        fig.tight_layout()
    paths = [
        plots.plot_rank_loads(steps, tmp_path / "loads.png"),
        plots.plot_balancedness({"static": [0.5, 0.6], "moonplan": [1, 1]}, tmp_path / "b.png"),
    ]
    assert all(p.exists() for p in paths)
    for fig in figs:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legends = [a.get_legend() for a in fig.axes if a.get_legend() is not None]
        assert len(legends) == 1
        box = legends[0].get_window_extent(renderer)
        assert not any(box.overlaps(a.get_window_extent(renderer)) for a in fig.axes)
        assert fig.bbox.contains(box.x1 - 1, box.y0 + 1)  # inside the figure, not cut off
        plt.close(fig)


def test_cli_persistent_slots_and_a_recorded_npz(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--persistent 0`` is the drift-only law; ``--slots`` reaches EPLB; a recorded
    ``.npz`` trace is measured over its last ``--steps`` steps, EPLB fitted before them."""
    argv = [*TINY, "--ep", "4", "--sigma", "1", "--json", "--policies", "static-linear,eplb"]
    assert run([*argv, "--persistent", "0"]) == 0
    drift = json.loads(capsys.readouterr().out)["rows"]
    assert run(argv) == 0
    persistent = json.loads(capsys.readouterr().out)["rows"]
    assert drift[0]["expert_maxvio"] != persistent[0]["expert_maxvio"]
    with pytest.raises(SystemExit):
        run([*TINY, "--persistent", "1.5"])
    capsys.readouterr()
    trace = np.stack([generate_counts("lognormal", ranks=2, experts=8, tokens=32, topk=2,
                                      seed=s).numpy() for s in range(12)])  # fmt: skip
    np.savez_compressed(tmp_path / "t.npz", counts=trace.astype(np.int16))
    rec = [
        "--counts",
        str(tmp_path / "t.npz"),
        "--model",
        "mixtral-8x7b",
        "--no-progress",
        "--json",
        "--steps",
        "4",
        "--policies",
        "static-linear,eplb,eplb-fast",
        "--slots",
        "1",
    ]
    assert run(rec) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["eplb"]["copies"] == 2 and rows["eplb-fast"]["copies"] == 2  # R * slots
    assert rows["eplb"]["new_copies"] > 0  # a re-placement's moves, planned from steps 0-3
