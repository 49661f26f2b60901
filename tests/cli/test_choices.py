"""``moonplan.cli.choices``: the names the parser offers equal their registries'.

The command builds its parser without importing torch (``--help`` stays fast), so it
holds its own copy of each list; these tests keep every copy equal to its source.
"""

from __future__ import annotations

from moonplan.cli import choices


def test_planner_names() -> None:
    from moonplan.plan.api import BACKENDS
    from moonplan.traces import COUNT_FAMILIES

    assert choices.PLAN_BACKENDS == BACKENDS
    assert choices.COUNT_FAMILIES == COUNT_FAMILIES


def test_preset_names() -> None:
    from moonplan.cost import PRESETS
    from moonplan.simulate.models import TREND_MODELS
    from moonplan.stepcost.hardware import HARDWARE

    assert choices.MODEL_PRESETS == tuple(sorted(PRESETS))
    assert choices.TREND_MODELS == TREND_MODELS
    assert choices.HARDWARE == tuple(sorted(HARDWARE))


def test_simulator_names() -> None:
    from moonplan.baselines.registry import names
    from moonplan.simulate.model_time import default_plan_us
    from moonplan.simulate.sweep import TOKEN_GRID
    from moonplan.stepcost.traffic import SCHEMES

    assert choices.POLICIES == names()
    assert default_plan_us()["moonep-greedy"] == choices.PLAN_US
    assert choices.TOKEN_GRID == TOKEN_GRID
    assert choices.DISPATCH_SCHEMES == SCHEMES


def test_simulator_defaults() -> None:
    from moonplan.baselines.eplb import DEPLOYED_PERIOD, DEPLOYED_WINDOW
    from moonplan.simulate.sweep import MEASURED_STEPS, WARMUP_STEPS
    from moonplan.traces.persistence import PERSISTENT_SHARE

    assert (choices.MEASURED_STEPS, choices.WARMUP_STEPS) == (MEASURED_STEPS, WARMUP_STEPS)
    assert choices.PERSISTENT_SHARE == PERSISTENT_SHARE
    assert (choices.DEPLOYED_WINDOW, choices.DEPLOYED_PERIOD) == (DEPLOYED_WINDOW, DEPLOYED_PERIOD)


def test_shm_dir() -> None:
    from moonplan.comm.shm_files import SHM_DIR

    assert choices.SHM_DIR == SHM_DIR
