"""The names the ``moonplan`` command offers, without importing torch.

Legend: none (names only).

``moonplan --help`` and every subcommand's ``--help`` answer in well under a second
because building the parser imports neither torch nor the packages that need it. The
registries that hold these names live in such packages, so the names are listed here
once more; ``tests/cli/test_choices.py`` checks that each list equals its registry.
"""

from __future__ import annotations

PLAN_BACKENDS = ("auto", "reference", "torch", "cuda")
"""``moonplan.plan.api.BACKENDS``."""

COUNT_FAMILIES = ("uniform", "lognormal", "zipf", "hot", "zero")
"""``moonplan.traces.COUNT_FAMILIES``: the families ``generate_counts`` draws."""

HARDWARE = ("a100-multinode", "h20-multinode", "h20-node", "h200-multinode", "h200-node")
"""``sorted(moonplan.stepcost.hardware.HARDWARE)``."""

DISPATCH_SCHEMES = ("record", "rank", "host")
"""``moonplan.stepcost.traffic.SCHEMES``."""

MODEL_PRESETS = ("deepseek-v3", "kimi-k3-like", "mixtral-8x7b")
"""``sorted(moonplan.cost.PRESETS)`` (``moonplan.cost`` imports numpy: 0.2 s)."""

TREND_MODELS = ("deepspeed-moe-1.3b-128", "olmoe-1b-7b")
"""``moonplan.simulate.models.TREND_MODELS`` (the simulator also takes every
``moonplan.cost`` preset and ``gshard-<E>e``)."""

POLICIES = (
    "static-linear",
    "static-round-robin",
    "capacity-1.0",
    "capacity-1.25",
    "eplb",
    "eplb-fast",
    "moonep-greedy",
    "moonplan",
    "moonplan-resident",
    "moonplan-auto",
)
"""``moonplan.baselines.registry.names()``: the built-in simulator policies, the default
of ``moonplan simulate --policies``."""

TOKEN_GRID = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""``moonplan.simulate.sweep.TOKEN_GRID``: tokens per rank of ``--break-even``."""

PLAN_US = 51.0
"""The MoonEP greedy's published planning time (µs) the simulator charges by default;
moonplan's own planners are charged their kernel's time by shape
(``moonplan.baselines.planner_time``, ``moonplan.simulate.model_time.default_plan_us()``)."""

MEASURED_STEPS = 32
"""``moonplan.simulate.sweep.MEASURED_STEPS``: measured steps per simulated point."""

WARMUP_STEPS = 8
"""``moonplan.simulate.sweep.WARMUP_STEPS``: steps run before measuring."""

PERSISTENT_SHARE = 0.996
"""``moonplan.traces.persistence.PERSISTENT_SHARE``: the persistent share of the generated
log-popularity's variance (measured on the shipped real traces)."""

DEPLOYED_WINDOW = 1000
"""``moonplan.baselines.eplb.DEPLOYED_WINDOW``: the deployed EPLB's window (steps)."""

DEPLOYED_PERIOD = 3000
"""``moonplan.baselines.eplb.DEPLOYED_PERIOD``: its rearrangement period (steps)."""

SHM_DIR = "/dev/shm"
"""``moonplan.comm.shm_files.SHM_DIR``."""


def listed(names: tuple[str, ...] | tuple[int, ...]) -> str:
    """``names`` for a help text: ``"a, b, c"``."""
    return ", ".join(str(n) for n in names)
