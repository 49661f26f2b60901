"""Estimated time of one MoE layer's forward step under one policy (with
``SimConfig.training``, its training step: the forward and its backward,
``moonplan.stepcost.training``).

The model is :class:`moonplan.stepcost.StepCost` (the same one the planner's
``policy="auto"`` and the runtime use), built from a hardware preset and a model
preset; see ``moonplan/stepcost/step_cost.py`` for the phases and the schedule.
This module adapts a policy's :class:`~moonplan.baselines.policies.PolicyStep` to it.

Legend:
    R ranks    E experts    H hidden size    F expert intermediate size (SwiGLU: 3 H x F)
    N records (token, k) of the step    rows_ER  rows each rank computes per expert

* **plan**: ``SimConfig.plan_us`` per planner call (``PolicyStep.planned``); by default
  each policy's registered ``plan_us`` at the point's ``(R, E)``: the MoonEP greedy's
  published 51 us, moonplan's kernel time by shape (``moonplan.baselines.planner_time``;
  ``moonplan-auto``'s early exit is charged its own, smaller time as a share of one
  call), 0 for static placements, EPLB and capacity, which plan off the critical path or
  not at all. ``moonplan-auto``'s slot placement decides on a host thread, off the device
  (``moonplan.plan.residency.refill.Decisions``): it costs the steps no device time, only
  the lag before its answer is used;
* **a refill's swap** (``PolicyStep.local_copies``): each staging row copied into its slot
  on the critical path reads and writes one expert's weights on its rank:
  ``2 * weight_read_s`` each, added to the fetch and exposed;
* **background copies** (``moonplan-auto``'s slot refill, ``PolicyStep.refill_ER``;
  EPLB's rearrangement moves, ``PolicyStep.background_C2``, a share
  ``background_share`` of them beside this step): charged. The copies take their link time
  alone on the links (``StepCost``'s fetch without dispatch: :func:`moves_link_s`, the same
  rates and the same busiest-link rule as moonplan's fetch); they run beside the step but
  overlap only its experts phase, when the links carry no dispatch or combine; the rest is
  exposed and added to the step (:func:`with_refill`: ``prefetch_s`` gains the link time,
  ``prefetch_exposed_s`` and ``total_s`` the exposed part);
* **a re-home's rows** (``PolicyStep.blocking_s``, ``moonplan-auto`` in training): their
  link time alone, on the critical path before the step (the runtime moves them between
  steps, at the start of the step after an optimizer step), added to the fetch and
  exposed;
* **fetch** (prefetch and direct reads): the weights a policy moves before its rows can
  run (``PolicyStep.fetch_ER``). ``SimConfig.overlap_prefetch=True`` (default: moonplan's
  runtime schedule) overlaps the fetch with dispatch and the home section; ``False`` puts
  it on the critical path alone;
* **dispatch**, **experts**, **combine**: see ``StepCost``.

The **force-balanced ideal** (:func:`ideal_time`) is the same model with every rank
executing ``N/R`` records spread evenly over ``max(1, E/R)`` experts, uniform
all-to-all traffic, no planning and no fetch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from moonplan.baselines.policy_base import PolicyStep
from moonplan.baselines.registry import PlanUs, infos, plan_us_at
from moonplan.cost import ModelPreset
from moonplan.plan.residency.refill import refill_link_s
from moonplan.simulate.dispatch_rows import scheme_step_traffic
from moonplan.stepcost import Hardware, StepCost, StepTime
from moonplan.stepcost.traffic import pair_traffic
from moonplan.stepcost.training import training_time


def registered_us(attr: str) -> dict[str, PlanUs]:
    """``PolicyInfo.<attr>`` (microseconds, or a function of ``(R, E)``) of every
    registered policy that has one (not 0)."""
    got = {n: getattr(p, attr) for n, p in infos().items()}
    return {n: v for n, v in got.items() if callable(v) or v > 0}


def default_plan_us() -> dict[str, PlanUs]:
    """Planning time per planner call (us, or a function of ``(R, E)``) of every
    registered policy that plans on the critical path (its ``PolicyInfo.plan_us``: the
    MoonEP greedy 51 us, its published figure; moonplan's policies their kernel's time by
    shape, ``moonplan.baselines.planner_time``). Policies not listed plan nothing."""
    return registered_us("plan_us")


def default_round_us() -> dict[str, float]:
    """Device microseconds of one round of the ``resident`` candidate that
    ``policy="auto"``'s exit builds (``PolicyInfo.round_us``) of the policies that have it."""
    return {n: float(v) for n, v in registered_us("round_us").items() if not callable(v)}


def default_decide_us() -> dict[str, PlanUs]:
    """Host time per build of a slot-placement decision (``PolicyInfo.decide_us``) of the
    policies that place slots (``moonplan.baselines.decision_time``)."""
    return registered_us("decide_us")


def default_score_us() -> dict[str, PlanUs]:
    """Host time per (step, table) a slot-placement decision scores without a build
    (``PolicyInfo.score_us``) of the policies that place slots."""
    return registered_us("score_us")


def default_exit_us() -> dict[str, PlanUs]:
    """``policy="auto"``'s early-exit time (``PolicyInfo.exit_us``) of the policies that
    have one."""
    return registered_us("exit_us")


def default_exact_us() -> dict[str, PlanUs]:
    """The exact kernel's time (``PolicyInfo.exact_us``) of the policies that can serve it
    in place of their own call (``StepCost.exact_s``)."""
    return registered_us("exact_us")


@dataclass(frozen=True)
class SimConfig:
    """Simulator options.

    Attributes:
        weight_bytes: bytes per expert weight (2: bf16).
        act_bytes: bytes per activation element in the GEMM and the combine (2: bf16).
        dispatch_bytes: bytes per element sent by dispatch (2: bf16; 1 for FP8 dispatch).
        plan_us: planning time per policy name, microseconds (default
            :func:`default_plan_us`, read from the registry when the config is made).
        overlap_prefetch: the overlapped schedule (fetch during dispatch and the home
            section, as moonplan's runtime runs it; default); ``False``: fetch, then
            dispatch, one after the other.
        exit_us: ``policy="auto"``'s early exit per policy name (``StepCost.exit_s``);
            round_us: one round of the ``resident`` candidate it builds
            (``StepCost.round_s``); decide_us: a slot-placement decision's host time per
            build it counts (``StepCost.decide_s``); score_us: per (step, table) it scores
            without a build (``StepCost.score_s``); exact_us: one ``policy="exact"`` call
            (``StepCost.exact_s``); all read from the registry by default.
        dispatch: the transport's dispatch scheme for every policy alike
            (``moonplan.stepcost.traffic.SCHEMES``; ``"rank"``/``"host"`` need the step's
            token routing, ``moonplan.simulate.dispatch_rows``).
        training: every step is a training step, its forward and the backward that
            replays its plan (``moonplan.stepcost.training``), the ideal's too; what moves
            between the steps (a re-home's rows) and beside them is charged once.
    """

    weight_bytes: float = 2.0
    act_bytes: float = 2.0
    dispatch_bytes: float = 2.0
    plan_us: Mapping[str, PlanUs] = field(default_factory=default_plan_us)
    overlap_prefetch: bool = True
    dispatch: str = "record"
    exit_us: Mapping[str, PlanUs] = field(default_factory=default_exit_us)
    round_us: Mapping[str, float] = field(default_factory=default_round_us)
    decide_us: Mapping[str, PlanUs] = field(default_factory=default_decide_us)
    score_us: Mapping[str, PlanUs] = field(default_factory=default_score_us)
    exact_us: Mapping[str, PlanUs] = field(default_factory=default_exact_us)
    training: bool = False

    def plan_seconds(self, policy: str, num_ranks: int = 8, num_experts: int = 256) -> float:
        """Planning seconds of ``policy`` at ``(R, E)`` (0 when not listed)."""
        return plan_us_at(self.plan_us.get(policy, 0.0), num_ranks, num_experts) * 1e-6

    def step_cost(
        self, model: ModelPreset, hw: Hardware, policy: str = "", num_ranks: int = 8
    ) -> StepCost:
        """The :class:`StepCost` of ``model`` on ``hw`` with ``policy``'s planning times at
        ``num_ranks`` ranks (and the model's experts)."""
        E = model.num_experts
        return StepCost.from_hardware(
            hw,
            model,
            weight_bytes=self.weight_bytes,
            act_bytes=self.act_bytes,
            dispatch_bytes=self.dispatch_bytes,
            plan_us=plan_us_at(self.plan_us.get(policy, 0.0), num_ranks, E),
            overlap=self.overlap_prefetch,
            exit_us=plan_us_at(self.exit_us.get(policy, 0.0), num_ranks, E),
            round_us=float(self.round_us.get(policy, 0.0)),
            decide_us=plan_us_at(self.decide_us.get(policy, 0.0), num_ranks, E),
            score_us=plan_us_at(self.score_us.get(policy, 0.0), num_ranks, E),
            exact_us=plan_us_at(self.exact_us.get(policy, 0.0), num_ranks, E),
        )


def step_time(
    step: PolicyStep,
    model: ModelPreset,
    hw: Hardware,
    cfg: SimConfig,
    topk_ids: torch.Tensor | None = None,
    *,
    counts_RE: torch.Tensor | None = None,
) -> StepTime:
    """Estimated :class:`StepTime` of one policy step (see the module docstring);
    ``topk_ids`` (``[R, S, K]`` experts of the step's records) is needed for
    ``cfg.dispatch`` other than ``"record"``, with ``counts_RE`` (int64 ``[R, E]``) its
    ``token_counts`` when the caller already has them (else they are counted here)."""
    E, R = step.rows_ER.shape
    fetch_ER = step.fetch_ER if step.fetch_ER is not None else torch.zeros(E, R, dtype=torch.bool)
    src_E = step.src_E if step.src_E is not None else torch.zeros(E, dtype=torch.int64)
    cost = record = cfg.step_cost(model, hw, step.name, R)
    traffic = None
    if cfg.dispatch != "record":
        traffic = scheme_step_traffic(step, topk_ids, cfg.dispatch, cost.domain_size(R), counts_RE)
        cost = cost.scaled(dispatch=cfg.dispatch)
    t = cost.step_time(
        step.rows_ER, step.sent_RE, fetch_ER, src_E, planned=step.planned, traffic=traffic
    )
    if cfg.training:  # the backward replays the plan
        t = training_time(t)
    link_s = 0.0 if step.refill_ER is None else refill_link_s(record, step.refill_ER, src_E)
    if step.background_C2.shape[0]:
        link_s += step.background_share * moves_link_s(record, step.background_C2, R)
    if link_s > 0:
        t = with_refill(t, link_s)
    if step.local_copies:
        t = with_exposed(t, 2 * record.weight_read_s * step.local_copies)
    if step.blocking_s:  # a re-home's rows, moved between the steps
        t = with_exposed(t, step.blocking_s)
    return t


def moves_link_s(cost: StepCost, moves_C2: torch.Tensor, num_ranks: int) -> float:
    """Seconds the weight copies ``moves_C2`` (int64 ``[C, 2]``, ``(source, destination)``)
    take alone on the links: ``StepCost``'s fetch rule (base latency plus the busiest rank's
    busiest link direction, NVLink and network in parallel, sends and receives full duplex),
    each copy from its own source (0 when there is none)."""
    if moves_C2.shape[0] == 0:
        return 0.0
    traffic = pair_traffic(moves_C2, num_ranks, cost.domain_size(num_ranks))
    intra_R = np.maximum(traffic.send_intra_R, traffic.recv_intra_R) * cost.copy_s_intra
    inter_R = np.maximum(traffic.send_inter_R, traffic.recv_inter_R) * cost.copy_s_inter
    return cost.base_latency_s + float(np.maximum(intra_R, inter_R).max())


def with_refill(t: StepTime, link_s: float) -> StepTime:
    """``t`` with a background copy of ``link_s`` link seconds beside it: hidden behind
    the experts phase (links idle), the rest exposed."""
    exposed = max(0.0, link_s - t.experts_s)
    return dataclasses.replace(
        t,
        prefetch_s=t.prefetch_s + link_s,
        prefetch_exposed_s=t.prefetch_exposed_s + exposed,
        total_s=t.total_s + exposed,
    )


def with_exposed(t: StepTime, copy_s: float) -> StepTime:
    """``t`` with ``copy_s`` of weight copies on the critical path (fetch, all exposed)."""
    return dataclasses.replace(
        t,
        prefetch_s=t.prefetch_s + copy_s,
        prefetch_exposed_s=t.prefetch_exposed_s + copy_s,
        total_s=t.total_s + copy_s,
    )


def ideal_time(
    records: float, num_ranks: int, model: ModelPreset, hw: Hardware, cfg: SimConfig
) -> StepTime:
    """The force-balanced ideal for ``records`` records (N) on ``num_ranks`` ranks."""
    c = cfg.step_cost(model, hw)
    R, E = num_ranks, model.num_experts
    per_rank = records / R
    experts_per_rank = max(1.0, E / R)
    rows = per_rank / experts_per_rank
    tiled = math.ceil(rows / c.tile_rows) * c.tile_rows
    flop = c.row_flop_s * tiled * experts_per_rank
    mem = (c.weight_read_s * experts_per_rank if rows > 0 else 0.0) + c.row_mem_s * per_rank
    experts = max(flop, mem)
    dispatch = _uniform_a2a(per_rank, R, c, c.dispatch_row_s_intra, c.dispatch_row_s_inter)
    combine = _uniform_a2a(per_rank, R, c, c.combine_row_s_intra, c.combine_row_s_inter)
    t = StepTime(0.0, 0.0, 0.0, dispatch, experts, combine, dispatch + experts + combine)
    return training_time(t) if cfg.training else t


def _uniform_a2a(per_rank: float, R: int, c: StepCost, intra_s: float, inter_s: float) -> float:
    if R <= 1:
        return 0.0
    G = c.domain_size(R)
    intra = per_rank * (G - 1) / R * intra_s
    inter = per_rank * (R - G) / R * inter_s
    return c.base_latency_s + c.per_peer_latency_s * (R - 1) + max(intra, inter)


def mean_time(times: list[StepTime]) -> StepTime:
    """Phase-wise mean of several :class:`StepTime`."""
    if not times:
        raise ValueError("mean_time needs at least one StepTime")
    n = len(times)
    phases = zip(*(dataclasses.astuple(t) for t in times), strict=True)
    return StepTime(*(sum(p) / n for p in phases))
