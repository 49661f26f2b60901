"""The acceptance sweep of ``moonplan-auto``: never slower than the best peer, near the ideal.

Legend: R ranks (EP size), E experts, S tokens per rank, sigma the lognormal skew.

A *point* is ``(model, hardware, R, sigma, S)``: one drifting trace
(:func:`moonplan.simulate.sweep.simulate_trace`, ``warmup`` steps then ``steps``
measured) on which ``moonplan-auto`` and its peers run. Its verdicts:

* ``vs_peers``: ``moonplan-auto``'s mean step time over the least of the peers'
  (:data:`PEERS`: static EP with linear and with round-robin placement, EPLB as deployed
  and re-placing every 4 steps with its moves charged, the MoonEP greedy, moonplan exact
  and moonplan with resident slots); the bar is :data:`PEER_BAR`;
* ``vs_ideal``: its mean step time over the force-balanced ideal (the bar
  :data:`IDEAL_BAR` applies at :data:`IDEAL_POINT` only).

``moonplan-auto`` makes one planner call a step, charged the planner's device time by shape
(``moonplan.baselines.planner_time``), over slots placed from a window of loads and refilled
beside the steps (``moonplan.plan.residency``).

:func:`standings` reports, per policy, the points it wins and its worst ratio to the
best; :func:`run_recorded` runs the same comparison on recorded traces.

Points need ``E >= R`` (every rank holds at least one home expert: with fewer
experts than ranks static EP leaves ranks idle and is no deployment anyone runs),
so Mixtral-8x7B (8 experts) is swept at EP 8 only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moonplan.plan.residency.window import WINDOW
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.simulate.sweep import (
    MEASURED_STEPS,
    WARMUP_STEPS,
    SweepSpec,
    policy_options,
    simulate_trace,
    spec_point,
)
from moonplan.stepcost.hardware import get_hardware
from moonplan.traces.persistence import PERSISTENT_SHARE

Progress = Callable[[int, int, str], None]
"""``progress(done, total, label)`` callback."""

AUTO = "moonplan-auto"
ORDERED = "moonplan-auto-ordered"
"""Auto over a home order from a profile (the runtime's ``home_order=``): reported beside
:data:`AUTO` where listed, never one of its peers."""
PEERS = (
    "static-linear",
    "static-round-robin",
    "eplb",
    "eplb-fast",
    "moonep-greedy",
    "moonplan",
    "moonplan-resident",
)
"""The policies ``moonplan-auto`` must not be slower than (beyond :data:`PEER_BAR`)."""
EPLB_MODELS = ("eplb", "eplb-fast")
PEER_BAR = 1.01
IDEAL_BAR = 1.06
IDEAL_POINT = ("deepseek-v3", "h200-node", 8, 1.0, 4096)
"""``(model, hardware, R, sigma, S)`` where ``moonplan-auto`` must be within :data:`IDEAL_BAR`."""

Point = tuple[str, str, int, float, int]


@dataclass(frozen=True)
class AcceptanceGrid:
    """The grid of points (every combination with ``E >= R``) and the trace settings.

    Attributes:
        models, hardware: preset names.
        ranks: EP sizes.
        sigmas: lognormal skews.
        tokens: tokens per rank per step.
        steps, warmup: measured steps per point, and steps run before them (``eplb-fast``'s
            window, the resident slots; the deployed EPLB's window is drawn before the trace).
        rho, seed: the drifting part's step-to-step correlation, and the seed.
        persistent: the persistent share of the log-popularity's variance (0: drift only).
        slots: redundant slots per rank for every policy that takes them: the same memory
            for moonplan's slots and EPLB's redundant experts (default 2: the runtime's
            default, ``moonplan.runtime.slot_budget``; ``None``: each policy's own).
    """

    models: tuple[str, ...] = ("deepseek-v3", "mixtral-8x7b", "kimi-k3-like")
    hardware: tuple[str, ...] = ("h200-node", "h20-node", "h200-multinode")
    ranks: tuple[int, ...] = (8, 16, 64)
    sigmas: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0)
    tokens: tuple[int, ...] = (16, 64, 256, 1024, 4096, 16384)
    steps: int = MEASURED_STEPS
    warmup: int = WARMUP_STEPS
    rho: float = 0.99
    seed: int = 0
    persistent: float = PERSISTENT_SHARE
    slots: int | None = 2

    def spec(self, model: str, hardware: str) -> SweepSpec:
        """The :class:`SweepSpec` of this grid's traces for one model and hardware."""
        return SweepSpec(
            model=model, hardware=hardware, steps=self.steps, warmup=self.warmup,
            rho=self.rho, seed=self.seed, persistent=self.persistent, slots=self.slots,
        )  # fmt: skip

    def points(self) -> list[Point]:
        """Every ``(model, hardware, R, sigma, S)`` of the grid with ``E >= R``."""
        out = []
        for model in self.models:
            E = get_model(model).num_experts
            for hw in self.hardware:
                get_hardware(hw)  # a bad name fails before the sweep starts
                for R in self.ranks:
                    if E >= R:
                        out += [(model, hw, R, s, S) for s in self.sigmas for S in self.tokens]
        return out


def acceptance_point(
    point: Point,
    grid: AcceptanceGrid,
    cfg: SimConfig | None = None,
    policies: Sequence[str] = (*PEERS, AUTO),
) -> dict[str, Any]:
    """Run ``policies`` on one point's trace; the verdicts of the module docstring.

    Returns:
        dict with the point (``model``, ``hardware``, ``ranks``, ``sigma``, ``tokens``),
        ``ideal_us``, ``us`` (policy -> mean step us), ``rel_ideal`` (policy -> ratio),
        ``best_peer`` and ``best_peer_us`` (least of the peers present),
        ``vs_peers``, ``vs_ideal``, ``choices`` (auto's candidate -> steps),
        ``phases`` (auto's mean phases, us), ``moved_mb`` (policy -> expert weights moved
        per step, MB: on the critical path or, for EPLB, in the background), ``vs_static``
        (auto over static EP with linear placement), a diagnosis of the planning:
        ``unplanned_us`` (auto's time without its planning) and ``vs_peers_unplanned``.
    """
    cfg = cfg or SimConfig()
    model, hw, R, sigma, S = point
    spec = grid.spec(model, hw)
    m, h = get_model(model), get_hardware(hw)
    rows = {r["policy"]: r for r in spec_point(spec, m, h, cfg, R, S, sigma, policies)}
    where = {"model": model, "hardware": hw, "ranks": R, "sigma": sigma, "tokens": S}
    return verdicts(where, rows, policies, cfg)


def verdicts(
    point: dict[str, Any],
    rows: dict[str, dict[str, Any]],
    policies: Sequence[str],
    cfg: SimConfig,
) -> dict[str, Any]:
    """The verdicts of :func:`acceptance_point` from one point's rows (policy -> row)."""
    peers = [p for p in policies if p in PEERS]
    if AUTO not in rows or not peers:
        raise ValueError(f"an acceptance point needs {AUTO} and at least one of {PEERS}")
    best = min(peers, key=lambda p: rows[p]["total_us"])
    auto = rows[AUTO]
    unplanned = auto["total_us"] - auto["plan_us"]
    static = rows.get("static-linear", {}).get("total_us", math.nan)
    phases = ("plan_us", "prefetch_us", "prefetch_exposed_us", "dispatch_us", "experts_us")
    return {
        **point,
        "ideal_us": auto["ideal_us"],
        "us": {p: r["total_us"] for p, r in rows.items()},
        "moved_mb": {p: r.get("moved_mb", 0.0) for p, r in rows.items()},
        "dropped": {p: r.get("dropped_fraction", 0.0) for p, r in rows.items()},
        "rel_ideal": {p: r["rel_ideal"] for p, r in rows.items()},
        "best_peer": best,
        "best_peer_us": rows[best]["total_us"],
        "vs_peers": auto["total_us"] / rows[best]["total_us"],
        "vs_ideal": auto["rel_ideal"],
        "vs_static": auto["total_us"] / static,
        "unplanned_us": unplanned,
        "vs_peers_unplanned": unplanned / rows[best]["total_us"],
        "choices": auto.get("choices", {}),
        "phases": {k: auto[k] for k in (*phases, "combine_us", "total_us")},
        **_ordered(rows, rows[best]["total_us"], static),
    }


def _ordered(rows: dict[str, dict[str, Any]], best_us: float, static_us: float) -> dict[str, Any]:
    """:data:`ORDERED`'s verdicts where it ran: against the same best peer, the ideal and
    static EP (linear), and its choices."""
    if ORDERED not in rows:
        return {}
    row = rows[ORDERED]
    return {"ordered_vs_peers": row["total_us"] / best_us, "ordered_vs_ideal": row["rel_ideal"],
            "ordered_vs_static": row["total_us"] / static_us,
            "ordered_choices": row.get("choices", {})}  # fmt: skip


def run_acceptance(
    grid: AcceptanceGrid,
    cfg: SimConfig | None = None,
    progress: Progress | None = None,
    policies: Sequence[str] = (*PEERS, AUTO),
) -> list[dict[str, Any]]:
    """:func:`acceptance_point` of every point of ``grid`` with ``policies``, in grid order."""
    points = grid.points()
    rows = []
    for i, point in enumerate(points):
        if progress:
            progress(i, len(points), "{} {} EP={} sigma={:g} S={}".format(*point))
        rows.append(acceptance_point(point, grid, cfg, policies))
    if progress:
        progress(len(points), len(points), "done")
    return rows


def worst(rows: Sequence[dict[str, Any]], n: int = 10) -> list[dict[str, Any]]:
    """The ``n`` points with the largest ``vs_peers`` (ties: grid order)."""
    return sorted(rows, key=lambda r: -r["vs_peers"])[:n]


def failures(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points above :data:`PEER_BAR`, and :data:`IDEAL_POINT` if it is above :data:`IDEAL_BAR`."""
    bad = [r for r in rows if r["vs_peers"] > PEER_BAR]
    ideal = [r for r in rows if _key(r) == IDEAL_POINT and r["vs_ideal"] > IDEAL_BAR]
    return bad + [r for r in ideal if r not in bad]


CLASSES = ("planning", "myopia", "static", "eplb", "greedy")
"""Causes of a point above :data:`PEER_BAR`, in the order :func:`classify` tries them."""


def classify(r: dict[str, Any]) -> str:
    """Why auto is above the bar at point ``r`` (the first class that fits; ``""`` within it).

    ``planning``: without its planner call's time auto would be within the bar; ``myopia``:
    ``moonplan-resident`` (exact balance every step, resident slots kept) is within it;
    ``static``: static EP (either placement) is; ``eplb``: only EPLB (either model) is;
    ``greedy``: the MoonEP greedy or moonplan exact is (and not EPLB alone).
    """
    if r["vs_peers"] <= PEER_BAR:
        return ""
    if r["vs_peers_unplanned"] <= PEER_BAR:
        return "planning"
    ok = {p for p in PEERS if p in r["us"] and r["us"][p] <= PEER_BAR * r["best_peer_us"]}
    if "moonplan-resident" in ok:
        return "myopia"
    if ok & {"static-linear", "static-round-robin"}:
        return "static"
    return "eplb" if ok <= set(EPLB_MODELS) else "greedy"


def _key(r: dict[str, Any]) -> Point:
    return (r["model"], r["hardware"], r["ranks"], r["sigma"], r["tokens"])


def standings(
    rows: Sequence[dict[str, Any]], policies: Sequence[str] = (*PEERS, AUTO)
) -> list[dict[str, Any]]:
    """Per policy of ``policies``: at how many points it is the best of ``policies`` (ties
    count for each tied policy), its worst and its geometric-mean ratio to that best, over
    the points of ``rows`` (:func:`acceptance_point` results) that ran every one of them."""
    full = [r for r in rows if all(p in r["us"] for p in policies)]
    if not full:
        raise ValueError(f"no point ran all of {list(policies)}")
    out = []
    for p in policies:
        ratios = [r["us"][p] / min(r["us"][q] for q in policies) for r in full]
        logs = sum(math.log(x) for x in ratios)
        out.append({"policy": p, "points": len(full),
                    "wins": sum(x <= 1.0 + 1e-9 for x in ratios),
                    "worst": max(ratios),
                    "geomean": math.exp(logs / len(ratios))})  # fmt: skip
    return out


RECORDED_STEPS = MEASURED_STEPS
"""Measured steps of a recorded trace in :func:`run_recorded` (its last ones)."""


def recorded_options(total_steps: int, steps: int) -> dict[str, Any]:
    """The deployed EPLB's schedule on a recorded trace of ``total_steps`` whose last
    ``steps`` are measured: its window and period scaled to half the warm-up, so that it
    has re-placed from a full window (and started the next re-placement's moves) before
    the measured steps: a recorded trace is shorter than the deployed schedule."""
    half = max(1, (total_steps - steps) // 2)
    return {"eplb_window": half, "eplb_period": half, "eplb_first": half}


def profile_loads(counts_TRE: torch.Tensor, steps: int, window: int = WINDOW) -> torch.Tensor:
    """int64 ``[S, E]``: the per-step loads ``moonplan-auto-ordered`` takes its order from
    on a recorded trace (its ``profile``): the last ``window`` steps of the warm-up (every
    step before the last ``steps``), as ``rehome("profile")`` at the warm-up's end reads
    them. The measured steps come after every step it reads."""
    T = counts_TRE.shape[0]
    return counts_TRE[max(0, T - steps - window) : T - steps].sum(1)


def run_recorded(
    traces: Mapping[str, torch.Tensor],
    model: str,
    hardware: Sequence[str],
    cfg: SimConfig | None = None,
    policies: Sequence[str] = (*PEERS, AUTO),
    steps: int = RECORDED_STEPS,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """:func:`verdicts` of ``policies`` on every recorded trace (name -> int64 ``[T, R, E]``)
    on every hardware preset: the last ``steps`` steps measured, the others warm-up
    (:func:`recorded_options` for the deployed EPLB). On a training trace (``train-*``)
    moonplan's slots go stale at every step, as in the runtime (``stale_slots``), and
    each step is charged its backward (``SimConfig.training``).
    ``moonplan-auto`` re-homes by itself as the runtime would: serving, once, inside the
    warm-up; on a training trace where rent or buy says, each move charged;
    :data:`ORDERED` (where listed) takes its order from
    :func:`profile_loads`. Rows carry
    ``trace`` and ``sigma`` ``None``."""
    cfg = cfg or SimConfig()
    m = get_model(model)
    jobs = [(name, hw) for name in traces for hw in hardware]
    out = []
    for i, (name, hw) in enumerate(jobs):
        if progress:
            progress(i, len(jobs), f"{name} {hw}")
        counts = traces[name]
        T, R, _ = counts.shape
        if T <= steps:
            raise ValueError(f"trace {name} has {T} steps, needs more than {steps}")
        h = get_hardware(hw)
        opts = {**policy_options(h, R, eplb=recorded_options(T, steps)),
                "stale_slots": name.startswith("train")}  # fmt: skip
        if ORDERED in policies:  # the only policy that takes it
            opts["profile"] = profile_loads(counts, steps)
        cfg_n = dataclasses.replace(cfg, training=opts["stale_slots"])  # with its backward
        got = simulate_trace(counts, m, h, cfg_n, policies, warmup=T - steps, options=opts)
        rows = {r["policy"]: r for r in got}
        tokens = float(counts[T - steps :].sum()) / (steps * R * m.top_k)
        point = {"trace": name, "model": m.name, "hardware": hw, "ranks": R, "sigma": None,
                 "tokens": tokens}  # fmt: skip
        out.append(verdicts(point, rows, policies, cfg))
    if progress:
        progress(len(jobs), len(jobs), "done")
    return out
