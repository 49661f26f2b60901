"""Estimated time of one MoE layer's forward step under one policy: a roofline model.

Legend:
    R ranks    E experts    H hidden size    F expert intermediate size (SwiGLU: 3 H x F)
    N records (token, k) of the step    tile: GEMM tile rows (``Hardware.gemm_tile_rows``)
    rows_ER  rows each rank computes per expert    load_R records per rank

Phases (seconds), run one after the other on the critical path:

* **plan**: per-policy constant (``SimConfig.plan_us``; 51 us for moonplan and the
  greedy, MoonEP's published GPU planning time; 0 for static placements, EPLB
  and capacity, which plan off the critical path or not at all);
* **prefetch**: expert weights that must arrive before the experts run
  (``3*H*F*weight_bytes`` each); per rank, copies over NVLink and over the NIC
  proceed in parallel, sends and receives are full duplex; the slowest rank
  sets the time, plus the base latency. ``overlap_prefetch=True`` hides it
  (e.g. behind attention) and leaves it out of the total;
* **dispatch** and **combine**: ``base + per_peer * (R-1)`` latency plus the
  slowest rank's largest per-link volume (rows x ``H`` x bytes) over that link's
  achievable bandwidth (routing in ``traffic.py``); combine moves the same rows
  back at ``act_bytes``;
* **experts**: per rank a grouped SwiGLU GEMM, roofline of the whole group:
  ``max(FLOP / achievable rate, bytes / HBM bandwidth)``, with
  ``FLOP = 6*H*F*sum_e tile(rows_e)`` (rows padded to tiles: the per-expert
  efficiency loss for small row counts) and bytes = weights of every expert with
  rows (``3*H*F*weight_bytes`` each) + activations ``rows*(2H + 2F)*act_bytes``
  (fused gate/up/activation). The slowest rank sets the time.

The **force-balanced ideal** (:func:`ideal_time`) is the same model with every rank
executing ``N/R`` records spread evenly over ``max(1, E/R)`` experts, uniform
all-to-all traffic, no planning and no prefetch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from moonplan.baselines.policies import PolicyStep
from moonplan.cost import ModelPreset
from moonplan.simulate.hardware import Hardware
from moonplan.simulate.models import expert_bytes
from moonplan.simulate.traffic import Traffic, dispatch_traffic, pair_traffic

DEFAULT_PLAN_US: Mapping[str, float] = MappingProxyType(
    {"moonplan": 51.0, "moonplan-resident": 51.0, "moonep-greedy": 51.0}
)
"""Planning time per step (us) on the critical path; MoonEP reports ~51 us on H20/H200 EP8.
Policies not listed plan nothing per step."""


@dataclass(frozen=True)
class SimConfig:
    """Simulator options.

    Attributes:
        weight_bytes: bytes per expert weight (2: bf16).
        act_bytes: bytes per activation element in the GEMM and the combine (2: bf16).
        dispatch_bytes: bytes per element sent by dispatch (2: bf16; 1 for FP8 dispatch).
        plan_us: planning time per policy name, microseconds (default ``DEFAULT_PLAN_US``).
        overlap_prefetch: hide the prefetch (it then costs nothing on the critical path).
    """

    weight_bytes: float = 2.0
    act_bytes: float = 2.0
    dispatch_bytes: float = 2.0
    plan_us: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_PLAN_US))
    overlap_prefetch: bool = False

    def plan_seconds(self, policy: str) -> float:
        """Planning seconds of ``policy`` (0 when not listed)."""
        return float(self.plan_us.get(policy, 0.0)) * 1e-6


@dataclass(frozen=True)
class StepTime:
    """Seconds per phase of one MoE layer step, and their critical-path total."""

    plan_s: float
    prefetch_s: float
    dispatch_s: float
    experts_s: float
    combine_s: float
    total_s: float

    def as_us(self) -> dict[str, float]:
        """The phases in microseconds, keyed ``plan_us``, ..., ``total_us``."""
        names = ("plan", "prefetch", "dispatch", "experts", "combine", "total")
        return {f"{n}_us": getattr(self, f"{n}_s") * 1e6 for n in names}


def _tiles(rows: torch.Tensor, tile: int) -> torch.Tensor:
    return torch.ceil(rows / tile) * tile


def expert_time_R(
    rows_ER: torch.Tensor, model: ModelPreset, hw: Hardware, cfg: SimConfig
) -> torch.Tensor:
    """float64 ``[R]`` seconds of each rank's grouped expert GEMM (module docstring)."""
    H, F = model.hidden_size, model.moe_intermediate_size
    rows = rows_ER.to(torch.float64)
    flops_R = 6.0 * H * F * _tiles(rows, hw.gemm_tile_rows).sum(0)
    weights_R = (rows > 0).sum(0).to(torch.float64) * expert_bytes(model, cfg.weight_bytes)
    acts_R = rows.sum(0) * (2 * H + 2 * F) * cfg.act_bytes
    return torch.maximum(flops_R / hw.flops, (weights_R + acts_R) / hw.hbm_bytes_per_s)


def _link_time(t: Traffic, unit_bytes: float, hw: Hardware) -> float:
    """Slowest rank's time on its busiest link direction, for ``unit_bytes`` per row."""
    intra = torch.maximum(t.send_intra_R, t.recv_intra_R).to(torch.float64) * unit_bytes
    inter = torch.maximum(t.send_inter_R, t.recv_inter_R).to(torch.float64) * unit_bytes
    per_rank = torch.maximum(intra / hw.nvlink_effective, inter / hw.net_effective)
    return float(per_rank.max()) if per_rank.numel() else 0.0


def all_to_all_time(t: Traffic, unit_bytes: float, hw: Hardware) -> float:
    """Seconds of one all-to-all: ``base + per_peer*(R-1)`` + busiest link (0 when ``R == 1``)."""
    R = t.local_R.numel()
    if R <= 1:
        return 0.0
    return hw.base_latency_s + hw.per_peer_latency_s * (R - 1) + _link_time(t, unit_bytes, hw)


def prefetch_time(moves_C2: torch.Tensor, num_ranks: int, one_copy: float, hw: Hardware) -> float:
    """Seconds to move ``moves_C2`` weight copies of ``one_copy`` bytes (0 when none)."""
    if moves_C2.shape[0] == 0:
        return 0.0
    t = pair_traffic(moves_C2, num_ranks, hw.domain(num_ranks))
    return hw.base_latency_s + _link_time(t, one_copy, hw)


def step_time(step: PolicyStep, model: ModelPreset, hw: Hardware, cfg: SimConfig) -> StepTime:
    """Estimated :class:`StepTime` of one policy step (see the module docstring)."""
    R = step.rows_ER.shape[1]
    H = model.hidden_size
    traffic = dispatch_traffic(step.sent_RE, step.rows_ER, hw.domain(R))
    plan = cfg.plan_seconds(step.name)
    prefetch = prefetch_time(step.moves_C2, R, expert_bytes(model, cfg.weight_bytes), hw)
    dispatch = all_to_all_time(traffic, H * cfg.dispatch_bytes, hw)
    experts = float(expert_time_R(step.rows_ER, model, hw, cfg).max())
    combine = all_to_all_time(traffic, H * cfg.act_bytes, hw)
    hidden = 0.0 if cfg.overlap_prefetch else prefetch
    return StepTime(
        plan, prefetch, dispatch, experts, combine, plan + hidden + dispatch + experts + combine
    )


def ideal_time(
    records: float, num_ranks: int, model: ModelPreset, hw: Hardware, cfg: SimConfig
) -> StepTime:
    """The force-balanced ideal for ``records`` records (N) on ``num_ranks`` ranks."""
    R, E = num_ranks, model.num_experts
    H, F = model.hidden_size, model.moe_intermediate_size
    per_rank = records / R
    experts_per_rank = max(1.0, E / R)
    rows = per_rank / experts_per_rank
    tiled = math.ceil(rows / hw.gemm_tile_rows) * hw.gemm_tile_rows
    flops = 6.0 * H * F * tiled * experts_per_rank
    weights = experts_per_rank * expert_bytes(model, cfg.weight_bytes) if rows > 0 else 0.0
    acts = per_rank * (2 * H + 2 * F) * cfg.act_bytes
    experts = max(flops / hw.flops, (weights + acts) / hw.hbm_bytes_per_s)
    dispatch = _uniform_a2a(per_rank, R, H * cfg.dispatch_bytes, hw)
    combine = _uniform_a2a(per_rank, R, H * cfg.act_bytes, hw)
    return StepTime(0.0, 0.0, dispatch, experts, combine, dispatch + experts + combine)


def _uniform_a2a(per_rank: float, R: int, unit_bytes: float, hw: Hardware) -> float:
    if R <= 1:
        return 0.0
    G = hw.domain(R)
    intra = per_rank * (G - 1) / R * unit_bytes / hw.nvlink_effective
    inter = per_rank * (R - G) / R * unit_bytes / hw.net_effective
    return hw.base_latency_s + hw.per_peer_latency_s * (R - 1) + max(intra, inter)


def mean_time(times: list[StepTime]) -> StepTime:
    """Phase-wise mean of several :class:`StepTime`."""
    if not times:
        raise ValueError("mean_time needs at least one StepTime")
    n = len(times)
    keys = ("plan_s", "prefetch_s", "dispatch_s", "experts_s", "combine_s", "total_s")
    vals: dict[str, Any] = {k: sum(getattr(t, k) for t in times) / n for k in keys}
    return StepTime(**vals)
