"""Run every policy on the same counts, estimate step times, and sweep skew and EP size.

Legend: T steps, R ranks (EP size), E experts, S tokens per rank, K top-k;
``counts_TRE`` int64 ``[T, R, E]``.

One *point* is a trace of ``warmup + steps`` steps; every policy runs over the
whole trace (moonplan-resident needs its previous plan, ``eplb-fast`` its window) and is
measured on the last ``steps``. A policy that plans from a longer past (the deployed
``eplb``: a window of 1000 steps, a rearrangement every 3000,
``moonplan.baselines.prehistory``) is first given the per-expert totals of the steps
before the trace it reads, drawn from the same routing law
(``moonplan.simulate.workload.prehistory``); the measured steps sit in the middle of its
period (``eplb_first``). A result row holds the mean step time per
phase (us), the mean force-balanced ideal (us), their ratio ``rel_ideal``, and
the balance metrics of ``moonplan.baselines.metrics``; for ``moonplan-auto`` also
``choices`` (candidate -> measured steps that took it).

Every policy gets the simulator's :class:`~moonplan.stepcost.StepCost` for the point
(``SimConfig.step_cost``); only ``moonplan-auto`` uses it, to choose its plan with the
same model that then charges the step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moonplan.baselines.eplb import DEPLOYED_PERIOD, DEPLOYED_WINDOW
from moonplan.baselines.eplb_fast import FAST_PERIOD
from moonplan.baselines.metrics import expert_maxvio, summarize
from moonplan.baselines.policy_base import Policy
from moonplan.baselines.prehistory import Prehistory, UsesPrehistory, step_ranges
from moonplan.baselines.registry import make_policy, names
from moonplan.cost import ModelPreset
from moonplan.simulate.model_time import SimConfig, StepTime, ideal_time, mean_time, step_time
from moonplan.simulate.models import expert_bytes, get_model
from moonplan.simulate.token_routing import token_trace
from moonplan.simulate.workload import (
    drifting_counts,
    drifting_popularity,
    prehistory,
    sigma_for_maxvio,
)
from moonplan.stepcost.hardware import Hardware, get_hardware
from moonplan.traces.persistence import PERSISTENT_SHARE

Progress = Callable[[int, int, str], None]
"""``progress(done, total, label)`` callback."""

Before = Callable[[torch.Tensor], Prehistory]
"""``before(steps_N)``: the per-expert totals of the steps ``steps_N`` before a trace."""

MEASURED_STEPS = 32
"""Measured steps per point by default (after the warm-up)."""
WARMUP_STEPS = 2 * FAST_PERIOD
"""Warm-up steps by default: two of ``eplb-fast``'s windows (the deployed EPLB's window is
drawn before the trace, ``moonplan.simulate.workload.prehistory``)."""


@dataclass(frozen=True)
class SweepSpec:
    """What to sweep: one model on one hardware preset over EP sizes and skews.

    Attributes:
        model, hardware: preset names (``get_model``, ``get_hardware``).
        ranks: EP sizes.
        sigmas: lognormal sigmas; ignored when ``maxvios`` is given.
        maxvios: expert MaxVio targets, each turned into a sigma.
        tokens: tokens per rank per step (S).
        policies: policy names (default: every listed one, ``registry.names()``).
        steps, warmup: measured steps, and steps run before them.
        rho: AR(1) correlation of the drifting part of the log-popularity, step to step.
        persistent: share of the log-popularity's variance that is persistent (fixed per
            expert; ``moonplan.traces.drift``); 0: the earlier model, drift only.
        seed: seeds the traces.
        slots: redundant slots per rank given to every policy that takes them (moonplan's
            ``slots``, EPLB's ``R * slots`` redundant experts); ``None``: each one's default.
        eplb_window, eplb_period: the deployed ``eplb``'s window and rearrangement period
            (steps; vLLM's defaults); its window is drawn before the trace, the measured
            steps in the middle of its period.
        eplb_groups: expert groups for EPLB's hierarchical policy (1: global policy; the
            generated traces do not model group-limited routing).
        exact: sample counts exactly (slow at large EP and skew); default the fast sampler.
    """

    model: str = "deepseek-v3"
    hardware: str = "h200-multinode"
    ranks: tuple[int, ...] = (8, 64)
    sigmas: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0)
    maxvios: tuple[float, ...] | None = None
    tokens: int = 4096
    policies: tuple[str, ...] = field(default_factory=names)
    steps: int = MEASURED_STEPS
    warmup: int = WARMUP_STEPS
    rho: float = 0.99
    persistent: float = PERSISTENT_SHARE
    seed: int = 0
    slots: int | None = None
    eplb_window: int = DEPLOYED_WINDOW
    eplb_period: int = DEPLOYED_PERIOD
    eplb_groups: int = 1
    exact: bool = False

    def skews(self, experts: int, topk: int) -> list[tuple[float, float | None]]:
        """``(sigma, maxvio target or None)`` of each skew point."""
        if self.maxvios is None:
            return [(float(s), None) for s in self.sigmas]
        return [
            (sigma_for_maxvio(m, experts, topk, self.seed, self.persistent), m)
            for m in self.maxvios
        ]

    def eplb_options(self, generated: bool = True) -> dict[str, Any]:
        """The deployed EPLB's schedule options: on a generated trace (its window drawn
        before it) the measured steps sit in the middle of its period; on a recorded one
        it rearranges once its window is full (``eplb_first`` = window)."""
        first = self.eplb_period // 2 if generated else self.eplb_window
        return {"eplb_window": self.eplb_window, "eplb_period": self.eplb_period,
                "eplb_first": first}  # fmt: skip


def policy_options(
    hw: Hardware,
    ranks: int,
    period: int = FAST_PERIOD,
    groups: int = 1,
    *,
    slots: int | None = None,
    eplb: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Options for :func:`make_policy`: nodes and expert groups (EPLB), ``slots`` (every
    policy that takes them), the deployed EPLB's schedule (``eplb``:
    :meth:`SweepSpec.eplb_options`) and ``eplb-fast``'s period and window
    (``period``: ``eplb-fast``'s)."""
    nodes = max(1, ranks // hw.domain(ranks))
    opts = {"period": period, "window": period, "nodes": nodes, "groups": groups, "slots": slots}
    return {**opts, **(eplb or {})}


def simulate_trace(
    counts_TRE: torch.Tensor,
    model: ModelPreset,
    hw: Hardware,
    cfg: SimConfig,
    policies: Sequence[str] | None = None,
    *,
    warmup: int = 0,
    options: dict[str, Any] | None = None,
    before: Before | None = None,
    topk_ids: Sequence[torch.Tensor] | None = None,
) -> list[dict[str, Any]]:
    """One row per policy (default: every listed one, ``registry.names()``): mean phase
    times and metrics over steps ``warmup:`` of the trace (``topk_ids``: each step's
    ``[R, S, K]`` token routing, for ``cfg.dispatch`` other than ``"record"``; its
    ``token_counts`` must be ``counts_TRE``, which serve every policy's routing, not
    recounted: shapes and per-rank totals are checked).

    ``options``: :func:`make_policy` options (default :func:`policy_options` for ``hw``
    and ``R``); ``before``: the steps before the trace, for the policies that read them
    (:class:`~moonplan.baselines.prehistory.UsesPrehistory`; ``None``: they see none, as
    on a recorded trace)."""
    T, R, E = counts_TRE.shape
    if E != model.num_experts:
        raise ValueError(f"counts have E = {E} experts, model {model.name} has {model.num_experts}")
    if not 0 <= warmup < T:
        raise ValueError(f"warmup = {warmup} leaves no measured step of {T}")
    if topk_ids is not None:
        _check_ids(counts_TRE, topk_ids)
    opts = {"cost": None, "layers": model.num_moe_layers,
            **(policy_options(hw, R) if options is None else options)}  # fmt: skip
    built = _built(policies, R, E, model, hw, cfg, opts, before)
    relabelled = [p.name for p in built if p.home_order is not None]
    if topk_ids is not None and relabelled:  # its plans name labels, the ids experts
        raise ValueError(f"{relabelled} relabel the experts (home_order): simulate them with "
                         'cfg.dispatch="record"')  # fmt: skip
    records = [int(c.sum()) for c in counts_TRE[warmup:]]
    ideal = mean_time([ideal_time(n, R, model, hw, cfg) for n in records])
    base = {
        "model": model.name,
        "hardware": hw.name,
        "ranks": R,
        "tokens_per_rank": sum(records) / len(records) / (R * model.top_k),
        "expert_maxvio": sum(expert_maxvio(c) for c in counts_TRE[warmup:]) / len(records),
        "ideal_us": ideal.total_s * 1e6,
    }
    return [
        _policy_row(policy, counts_TRE, model, hw, cfg, warmup, ideal, base, topk_ids)
        for policy in built
    ]


def _built(
    policies: Sequence[str] | None,
    R: int,
    E: int,
    model: ModelPreset,
    hw: Hardware,
    cfg: SimConfig,
    opts: dict[str, Any],
    before: Before | None,
) -> list[Policy]:
    """The policies, each with its own ``StepCost`` (its planner's time at ``R`` ranks), the
    ones that read the past primed with one shared prehistory (the union of the steps they
    read)."""
    built = []
    for name in names() if policies is None else policies:
        cost = cfg.step_cost(model, hw, name, R)
        built.append(make_policy(name, R, E, **{**opts, "cost": cost}))
    readers = [p for p in built if isinstance(p, UsesPrehistory)]
    if before is not None and readers:
        past = before(step_ranges([r for p in readers for r in p.steps_before()]))
        for p in readers:
            p.prime(past)
    return built


def _check_ids(counts_TRE: torch.Tensor, topk_ids: Sequence[torch.Tensor]) -> None:
    """``topk_ids`` has a ``[R, S, K]`` step per step of ``counts_TRE``, each rank's
    ``S*K`` records counted there (the cheap part of ``token_counts(ids) == counts``)."""
    T, R, _ = counts_TRE.shape
    if len(topk_ids) != T:
        raise ValueError(f"topk_ids has {len(topk_ids)} steps, the counts {T}")
    for t, ids in enumerate(topk_ids):
        fits = ids.dim() == 3 and ids.shape[0] == R
        if not fits or not bool((counts_TRE[t].sum(1) == ids[0].numel()).all()):
            raise ValueError(
                f"step {t}: topk_ids {tuple(ids.shape)} do not route the counts' "
                f"{counts_TRE[t].sum(1).tolist()} records per rank on {R} ranks"
            )


def _policy_row(
    policy: Policy,
    counts_TRE: torch.Tensor,
    model: ModelPreset,
    hw: Hardware,
    cfg: SimConfig,
    warmup: int,
    ideal: StepTime,
    base: dict[str, Any],
    topk_ids: Sequence[torch.Tensor] | None = None,
) -> dict[str, Any]:
    name = policy.name
    every = [policy.step(c) for c in counts_TRE]
    steps = every[warmup:]
    ids = list(topk_ids) if topk_ids is not None else [None] * len(every)
    t = mean_time(
        [
            step_time(s, model, hw, cfg, i, counts_RE=c)
            for s, i, c in zip(steps, ids[warmup:], counts_TRE[warmup:], strict=True)
        ]
    )
    row = {**base, "policy": name, **t.as_us()}
    if any(s.choice for s in steps):
        row["choices"] = dict(Counter(s.choice for s in steps))
    row["rel_ideal"] = t.total_s / ideal.total_s if ideal.total_s > 0 else 1.0
    metrics = summarize(steps, expert_bytes(model, cfg.weight_bytes))
    row.update(metrics)
    row["moved_mb"] = metrics["moved_bytes"] / 1e6
    return row


def sweep(
    spec: SweepSpec, cfg: SimConfig | None = None, progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Rows of :func:`simulate_trace` for every (EP size, skew) of ``spec``, tagged with
    ``sigma`` and ``maxvio_target``."""
    cfg = cfg or SimConfig()
    model, hw = get_model(spec.model), get_hardware(spec.hardware)
    skews = spec.skews(model.num_experts, model.top_k)
    total, rows = len(spec.ranks) * len(skews), []
    for i, (R, (sigma, target)) in enumerate((r, s) for r in spec.ranks for s in skews):
        if progress:
            progress(i, total, f"{model.name} EP={R} sigma={sigma:.2f}")
        got = spec_point(spec, model, hw, cfg, R, spec.tokens, sigma, spec.policies)
        rows += [{**r, "sigma": sigma, "maxvio_target": target} for r in got]
    if progress:
        progress(total, total, "done")
    return rows


def spec_point(
    spec: SweepSpec,
    model: ModelPreset,
    hw: Hardware,
    cfg: SimConfig,
    ranks: int,
    tokens: int,
    sigma: float,
    policies: Sequence[str],
) -> list[dict[str, Any]]:
    """:func:`simulate_trace` rows of ``policies`` on one drifting trace of ``ranks`` ranks,
    ``tokens`` per rank and skew ``sigma``; steps, warmup, rho, the persistent share, seed,
    exactness, slots and the EPLB settings come from ``spec``; the steps before the trace
    that a policy reads are drawn from the same law (``workload.prehistory``). With
    ``cfg.dispatch`` other than ``"record"`` every token's top-k set is sampled
    (``token_routing.drifting_tokens``, the model's group limit included) and the counts
    are theirs."""
    counts, ids, before = point_trace(spec, model, ranks, tokens, sigma, cfg.dispatch)
    opts = policy_options(
        hw, ranks, groups=spec.eplb_groups, slots=spec.slots, eplb=spec.eplb_options()
    )
    return simulate_trace(
        counts, model, hw, cfg, policies, warmup=spec.warmup, options=opts, before=before,
        topk_ids=ids,
    )  # fmt: skip


def point_trace(
    spec: SweepSpec,
    model: ModelPreset,
    ranks: int,
    tokens: int,
    sigma: float,
    dispatch: str = "record",
) -> tuple[torch.Tensor, list[torch.Tensor] | None, Before]:
    """The trace of :func:`spec_point` (int64 ``[T, R, E]`` counts), each step's token
    routing (``None`` where ``dispatch`` is ``"record"``) and the steps before it
    (``workload.prehistory`` of the same law)."""
    ids = None
    E, K, T = model.num_experts, model.top_k, spec.warmup + spec.steps
    law: dict[str, Any] = {"sigma": sigma, "rho": spec.rho, "seed": spec.seed,
                           "persistent": spec.persistent}  # fmt: skip
    if dispatch != "record":
        pops = drifting_popularity(E, steps=T, **law)
        counts, ids = token_trace(model, ranks, tokens, pops, seed=spec.seed + 1)
    else:
        counts = drifting_counts(ranks, E, tokens, K, steps=T, exact=spec.exact, **law)

    def before(steps_N: torch.Tensor) -> Prehistory:
        return prehistory(steps_N, ranks=ranks, experts=E, tokens=tokens, topk=K, **law)

    return counts, ids, before


TOKEN_GRID = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Default tokens-per-rank grid of :func:`break_even`."""


def break_even(
    model: str,
    hardware: str,
    ranks: int,
    sigma: float,
    *,
    tokens: Sequence[int] = TOKEN_GRID,
    policies: Sequence[str] = ("moonplan", "moonplan-resident", "moonplan-auto"),
    baseline: str = "static-linear",
    cfg: SimConfig | None = None,
    spec: SweepSpec | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Tokens per rank below which copying weights costs more than balancing saves.

    For each ``S`` in ``tokens`` (ascending) runs ``baseline`` and ``policies`` on the same
    drifting trace (steps, warmup, rho, seed from ``spec``) and records each policy's step
    time over the baseline's. A policy's break-even is the smallest ``S`` from which the
    ratio stays ``<= 1`` for every larger ``S`` of the grid (``None``: it never does).

    Returns:
        dict with ``model``, ``hardware``, ``ranks``, ``sigma``, ``tokens``,
        ``ratio`` (policy -> list of ratios) and ``break_even`` (policy -> S or None).
    """
    cfg, spec = cfg or SimConfig(), spec or SweepSpec()
    m, hw = get_model(model), get_hardware(hardware)
    grid = sorted(int(s) for s in tokens)
    ratio: dict[str, list[float]] = {p: [] for p in policies}
    for i, S in enumerate(grid):
        if progress:
            progress(i, len(grid), f"{m.name} EP={ranks} S={S}")
        rows = spec_point(spec, m, hw, cfg, ranks, S, sigma, [baseline, *policies])
        base = rows[0]["total_us"]
        for r in rows[1:]:
            ratio[r["policy"]].append(r["total_us"] / base)
    if progress:
        progress(len(grid), len(grid), "done")
    return {
        "model": m.name,
        "hardware": hw.name,
        "ranks": ranks,
        "sigma": sigma,
        "baseline": baseline,
        "tokens": grid,
        "ratio": ratio,
        "break_even": {p: _first_win(grid, r) for p, r in ratio.items()},
    }


def _first_win(grid: list[int], ratio: list[float]) -> int | None:
    """Smallest grid value from which every ratio is <= 1 (None if the last is > 1)."""
    best = None
    for S, r in zip(reversed(grid), reversed(ratio), strict=True):
        if r > 1.0:
            break
        best = S
    return best
