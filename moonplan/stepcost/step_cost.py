"""``StepCost``: the one model of an MoE step's time, shared by planner, runtime and simulator.

Legend:
    R ranks    E experts    H hidden size    F expert intermediate size (SwiGLU: 3 H x F)
    rows_ER   int64 rows rank ``r`` computes for expert ``e``
    sent_RE   int64 rows source ``s`` sends towards expert ``e`` (column sums == ``rows_ER`` rows)
    fetch_ER  bool  ``(e, r)`` whose weights must arrive on ``r`` this step before its rows run
              (new slots and direct reads; home experts and resident replicas are ``False``)
    src_E     int64 rank each expert's weights are fetched from (its home)
    C         weight copies of the step (``fetch_ER.sum()``)

Phases of one forward step, per rank ``r``:

* **plan**: ``planned * plan_s`` (planner calls on the critical path; ``policy="auto"``'s
  early exit is charged ``exit_s`` instead);
* **fetch** (prefetch and direct reads): ``C`` expert copies, each ``copy_s_intra`` over
  a fast link (same host or NVLink domain) or ``copy_s_inter`` across hosts; per rank,
  sends and receives are full duplex and the two link classes run in parallel; the
  busiest rank's busiest link sets ``P_alone = base_latency_s + link time``;
* **dispatch** ``D`` and **combine** ``Cb``: ``base + per_peer * (R-1)`` plus the busiest
  rank's busiest link time of its rows (routing rule in :mod:`moonplan.stepcost.traffic`;
  rows per record, or per (token, rank) or (token, host) under :attr:`StepCost.dispatch`);
* **experts**: a roofline per section, ``max(row_flop_s * tile-padded rows,
  weight_read_s * experts with rows + row_mem_s * rows)``: ``home_r`` for the rows whose
  weights are ready (home experts, residents), ``wait_r`` for the fetched rows. With the
  overlapped schedule the copies run beside the home section: each copy reads its
  expert's weights from the sender's memory and writes them into the receiver's, so the
  home section's memory side also pays ``weight_read_s`` per copy the rank sends or
  receives.

Schedule. ``overlap=True`` (moonplan's runtime): the fetch starts right after planning and
shares the links with dispatch, dispatch first, so the fetched weights are ready at
``P = max(P_alone, base + link time of dispatch rows and weight bytes together)``; each rank
runs its home section after dispatch and its fetched rows once they are ready::

    total = plan + max_r(max(D + home_r, P) + wait_r) + Cb

``overlap=False`` (everything one after the other)::

    total = plan + P_alone + D + max_r(home_r + wait_r) + Cb

``prefetch_exposed_s`` is ``total`` minus the same total with nothing to fetch.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moonplan.cost import ModelPreset, get_preset
from moonplan.host_arrays import host_bool, host_int64
from moonplan.stepcost.hardware import Hardware, get_hardware
from moonplan.stepcost.plan_compat import PlanTensors, step_inputs, warn_moved
from moonplan.stepcost.traffic import SCHEMES, Traffic, dispatch_traffic, pair_traffic

_RATE_FIELDS = (
    "row_flop_s",
    "weight_read_s",
    "row_mem_s",
    "copy_s_intra",
    "copy_s_inter",
    "dispatch_row_s_intra",
    "dispatch_row_s_inter",
    "combine_row_s_intra",
    "combine_row_s_inter",
    "base_latency_s",
    "per_peer_latency_s",
    "plan_s",
    "exit_s",
    "round_s",
    "decide_s",
    "score_s",
    "exact_s",
)
"""The float fields of :class:`StepCost`, in :meth:`StepCost.as_tensor` order."""


MAX_TILE_ROWS = 1 << 31
"""The largest GEMM tile a ``StepCost`` takes: a row count rounded up to it stays far below
``2**63`` in every form (the planner kernel's int64 included)."""


@dataclass(frozen=True)
class StepTime:
    """Seconds per phase of one MoE layer step, and their critical-path total.

    ``prefetch_s`` is the fetch's own time (weights moved, alone on the links);
    ``prefetch_exposed_s`` the part of it the step waits for; ``experts_s`` the slowest
    rank's expert sections.
    """

    plan_s: float
    prefetch_s: float
    prefetch_exposed_s: float
    dispatch_s: float
    experts_s: float
    combine_s: float
    total_s: float

    def as_us(self) -> dict[str, float]:
        """The phases in microseconds, keyed ``plan_us``, ..., ``total_us``."""
        return {f"{name[:-2]}_us": s * 1e6 for name, s in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class StepCost:
    """Seconds of one MoE layer step (forward) as a function of what a policy does.

    Every rate is in seconds per unit, per rank (see the module docstring for the
    schedule). Build one with :meth:`from_hardware` (presets), or from measured phase
    rates (the runtime's calibration), or by hand.

    Each field is documented where it is declared.
    """

    row_flop_s: float
    """Expert compute seconds per tile-padded row (``6*H*F / FLOP/s``)."""
    weight_read_s: float
    """Seconds to read one expert's weights from memory."""
    row_mem_s: float
    """Memory seconds per row of activations."""
    copy_s_intra: float
    """Seconds to move one expert's weights over a fast link (same host or NVLink domain)."""
    copy_s_inter: float
    """The same across hosts."""
    dispatch_row_s_intra: float
    """Dispatch seconds per row over a fast link."""
    dispatch_row_s_inter: float
    """Dispatch seconds per row across hosts."""
    combine_row_s_intra: float
    """Combine seconds per row over a fast link."""
    combine_row_s_inter: float
    """Combine seconds per row across hosts."""
    base_latency_s: float = 0.0
    """Fixed latency of one all-to-all or one fetch."""
    per_peer_latency_s: float = 0.0
    """Extra latency per peer of an all-to-all."""
    plan_s: float = 0.0
    """Seconds of one planner call on the critical path that builds a plan (``exact``, or
    ``policy="auto"`` scoring every candidate: ``moonplan.plan.choice``)."""
    exit_s: float = 0.0
    """Seconds of ``policy="auto"``'s early exit: the test on the counts alone, when it
    shows that static EP wins (``moonplan.plan.choice.bound``)."""
    round_s: float = 0.0
    """Device seconds of one round of the ``resident`` candidate's diffusion
    (``moonplan.plan.choice.resident``), which the early exit builds where replicas are
    resident and the cheap plans are above the bound on plans that copy nothing
    (``moonplan.plan.choice.reference``). The rounds run while the last one paid for
    itself; the exit builds the candidate only where it could beat the cheap plans by its
    least build (one round a rounding, ``rent.exit_build_s``). The exit's plans are scored
    with ``exit_s`` alone; whoever charges the step adds ``round_s`` for each round the
    exit ran (``Choice.rounds``)."""
    decide_s: float = 0.0
    """Host seconds per ``resident`` build that a slot-placement decision counts
    (``moonplan.plan.residency.refill.Decisions``): the decision runs on a host thread,
    and its answer is used once the steps covering its builds at this rate have passed.
    The runtime's calibration times it; 0 (not measured): ``exit_s``, the device's rate,
    and a step may wait for the host (``docs/runtime.md``)."""
    score_s: float = 0.0
    """Host seconds per (step, slot table) a slot-placement decision scores without that
    build (its links, ``placed`` plan and the exit's gate and bound), counted with the
    builds (:attr:`decide_s`). The runtime's calibration times it; 0: ``exit_s``."""
    exact_s: float = 0.0
    """Seconds of one ``policy="exact"`` call with ``previous=`` (the exact kernel), which
    ``policy="auto"``'s slot placement serves where exact balance every step is predicted
    fastest over its window (``moonplan.plan.residency.exact_way``). The runtime's
    calibration times it; 0 (not measured): :attr:`plan_s`, a full ``auto`` call, which
    builds the exact plan among its candidates."""
    tile_rows: int = 1
    """An expert's rows are padded to a multiple of this (GEMM tile)."""
    domain: int = 0
    """Ranks per fast-link domain (consecutive ranks); 0: all ranks share one."""
    overlap: bool = True
    """The overlapped schedule (fetch during dispatch and the home section)."""
    horizon: float | None = None
    """Deprecated and ignored (``policy="auto"`` no longer amortises a copy over future
    steps: it picks the least predicted time of this step, ``docs/planner-policy.md``);
    setting it warns. Removed in the next release."""
    dispatch: str = "record"
    """The dispatch scheme (``moonplan.stepcost.traffic.SCHEMES``): ``"record"`` (a row per
    record, routed from the counts) or ``"rank"``/``"host"``, whose unique rows need each
    record's destination: :meth:`step_time` then takes their ``traffic``
    (``scheme_traffic``)."""

    def __post_init__(self) -> None:
        for name, v in zip(_RATE_FIELDS, self.rates(), strict=True):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"StepCost.{name} must be a finite number >= 0, got {v!r}")
        if isinstance(self.tile_rows, bool) or not isinstance(self.tile_rows, int):
            raise ValueError(f"StepCost.tile_rows must be an integer >= 1, got {self.tile_rows!r}")
        if not 1 <= self.tile_rows <= MAX_TILE_ROWS:
            raise ValueError(
                f"StepCost.tile_rows must be an integer from 1 to {MAX_TILE_ROWS}, got "
                f"{self.tile_rows!r}"
            )
        if isinstance(self.domain, bool) or not isinstance(self.domain, int) or self.domain < 0:
            raise ValueError(f"StepCost.domain must be an integer >= 0, got {self.domain!r}")
        if self.horizon is not None:
            warnings.warn(
                "StepCost.horizon is deprecated and ignored: policy='auto' scores each "
                "candidate by the predicted time of this step (docs/planner-policy.md)",
                DeprecationWarning,
                stacklevel=3,
            )
        if self.dispatch not in SCHEMES:
            raise ValueError(f"StepCost.dispatch must be one of {SCHEMES}, got {self.dispatch!r}")

    # ---- construction ------------------------------------------------------------
    @classmethod
    def from_hardware(
        cls,
        hw: Hardware | str,
        model: ModelPreset | str,
        *,
        weight_bytes: float = 2.0,
        act_bytes: float = 2.0,
        dispatch_bytes: float = 2.0,
        plan_us: float = 51.0,
        overlap: bool = True,
        exit_us: float = 0.0,
        round_us: float = 0.0,
        decide_us: float = 0.0,
        score_us: float = 0.0,
        exact_us: float = 0.0,
    ) -> StepCost:
        """The roofline rates of ``model``'s MoE layer on a hardware preset.

        Args:
            hw: a :class:`Hardware` or a preset name (``moonplan.stepcost.HARDWARE``).
            model: a ``moonplan.cost.ModelPreset`` or a preset name (``moonplan.cost.PRESETS``).
            weight_bytes, act_bytes, dispatch_bytes: bytes per weight, per activation
                element (GEMM and combine) and per dispatched element.
            plan_us: microseconds of one planner call that builds a plan (51: MoonEP's
                published GPU planning time at EP8; ``moonplan.baselines.planner_time`` has
                moonplan's own by shape).
            overlap: the overlapped schedule (module docstring).
            exit_us: microseconds of ``policy="auto"``'s early exit (:attr:`exit_s`).
            round_us: device microseconds of one round of the ``resident`` candidate
                (:attr:`round_s`).
            decide_us: host microseconds per build a placement decision counts
                (:attr:`decide_s`).
            score_us: host microseconds per (step, table) a placement decision scores
                without a build (:attr:`score_s`).
            exact_us: microseconds of one ``policy="exact"`` call (:attr:`exact_s`).
        """
        if isinstance(hw, str):
            hw = get_hardware(hw)
        if isinstance(model, str):
            model = get_preset(model)
        H, F = model.hidden_size, model.moe_intermediate_size
        one_expert = 3.0 * H * F * weight_bytes
        return cls(
            row_flop_s=6.0 * H * F / hw.flops,
            weight_read_s=one_expert / hw.hbm_bytes_per_s,
            row_mem_s=(2 * H + 2 * F) * act_bytes / hw.hbm_bytes_per_s,
            copy_s_intra=one_expert / hw.nvlink_effective,
            copy_s_inter=one_expert / hw.net_effective,
            dispatch_row_s_intra=H * dispatch_bytes / hw.nvlink_effective,
            dispatch_row_s_inter=H * dispatch_bytes / hw.net_effective,
            combine_row_s_intra=H * act_bytes / hw.nvlink_effective,
            combine_row_s_inter=H * act_bytes / hw.net_effective,
            base_latency_s=hw.base_latency_s,
            per_peer_latency_s=hw.per_peer_latency_s,
            plan_s=plan_us * 1e-6,
            tile_rows=hw.gemm_tile_rows,
            domain=max(0, hw.nvlink_domain),
            overlap=overlap,
            exit_s=exit_us * 1e-6,
            round_s=round_us * 1e-6,
            decide_s=decide_us * 1e-6,
            score_s=score_us * 1e-6,
            exact_s=exact_us * 1e-6,
        )

    def scaled(self, **fields: Any) -> StepCost:
        """A copy with ``fields`` replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **fields)

    def rates(self) -> tuple[float, ...]:
        """The 17 rate fields' values, in the order of their names in ``_RATE_FIELDS``."""
        return (
            self.row_flop_s,
            self.weight_read_s,
            self.row_mem_s,
            self.copy_s_intra,
            self.copy_s_inter,
            self.dispatch_row_s_intra,
            self.dispatch_row_s_inter,
            self.combine_row_s_intra,
            self.combine_row_s_inter,
            self.base_latency_s,
            self.per_peer_latency_s,
            self.plan_s,
            self.exit_s,
            self.round_s,
            self.decide_s,
            self.score_s,
            self.exact_s,
        )

    def as_tensor(self) -> torch.Tensor:
        """float64 ``[17]`` of the rates (for agreeing across ranks, e.g. the element-wise max)."""
        return torch.tensor([float(v) for v in self.rates()], dtype=torch.float64)

    @classmethod
    def from_tensor(
        cls,
        rates: torch.Tensor,
        *,
        tile_rows: int = 1,
        domain: int = 0,
        overlap: bool = True,
    ) -> StepCost:
        """The inverse of :meth:`as_tensor` (``rates`` float ``[17]``); the non-rate fields
        are passed."""
        values = [float(v) for v in rates.reshape(-1).tolist()]
        if len(values) != len(_RATE_FIELDS):
            raise ValueError(f"expected {len(_RATE_FIELDS)} rates, got {len(values)}")
        kw: dict[str, Any] = dict(zip(_RATE_FIELDS, values, strict=True))
        return cls(**kw, tile_rows=tile_rows, domain=domain, overlap=overlap)

    # ---- prediction ----------------------------------------------------------------
    def domain_size(self, num_ranks: int) -> int:
        """Ranks per fast-link domain for a group of ``num_ranks`` (``>= 1``)."""
        return num_ranks if self.domain <= 0 else min(self.domain, num_ranks)

    def experts_R(self, rows_ER: Any) -> np.ndarray:
        """float64 ``[R]`` roofline seconds of each rank's grouped GEMM over ``rows_ER``."""
        rows = host_int64(rows_ER)
        return self._roofline(self._padded(rows).sum(0), (rows > 0).sum(0), rows.sum(0))

    def _padded(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` (int64) each padded up to a multiple of :attr:`tile_rows`."""
        t = self.tile_rows
        if t == 1:
            return rows
        if t & (t - 1) == 0:  # a power of two: one add and one mask
            return (rows + (t - 1)) & -t
        return -(-rows // t) * t

    def _roofline(
        self,
        padded_R: np.ndarray,
        experts_R: np.ndarray,
        rows_R: np.ndarray,
        copies_R: np.ndarray | None = None,
    ) -> np.ndarray:
        """float64 ``[R]``: ``max(row_flop_s * padded rows, weight_read_s * experts with rows
        + row_mem_s * rows [+ weight_read_s * copies])`` per rank from those sums
        (integer-valued, exact: the same floats as summing the rows as floats,
        ``moonplan.stepcost.reference``); ``copies_R``: weight copies the rank sends or
        receives beside this section (module docstring)."""
        flop_R = self.row_flop_s * padded_R
        mem_R = self.weight_read_s * experts_R + self.row_mem_s * rows_R
        if copies_R is not None:
            mem_R = mem_R + self.weight_read_s * copies_R
        return np.maximum(flop_R, mem_R)

    @staticmethod
    def _busiest(t: Traffic) -> tuple[np.ndarray, np.ndarray]:
        """Per rank, rows (or copies) on its busiest direction of each link class."""
        intra = np.maximum(t.send_intra_R, t.recv_intra_R).astype(np.float64)
        return intra, np.maximum(t.send_inter_R, t.recv_inter_R).astype(np.float64)

    def _all_to_all(
        self, R: int, busy: tuple[np.ndarray, np.ndarray], intra_s: float, inter_s: float
    ) -> float:
        """Seconds of one all-to-all of ``R`` ranks whose busiest links carry ``busy``."""
        if R <= 1:
            return 0.0
        intra, inter = busy
        link = float(np.maximum(intra * intra_s, inter * inter_s).max())
        return self.base_latency_s + self.per_peer_latency_s * (R - 1) + link

    def _dispatch_combine(self, R: int, busy: tuple[np.ndarray, np.ndarray]) -> tuple[float, float]:
        """:meth:`_all_to_all` of dispatch and of combine at once (the same products, one
        array op each for both)."""
        if R <= 1:
            return 0.0, 0.0
        intra, inter = busy
        intra_2 = np.array([self.dispatch_row_s_intra, self.combine_row_s_intra])[:, None]
        inter_2 = np.array([self.dispatch_row_s_inter, self.combine_row_s_inter])[:, None]
        D, Cb = np.maximum(intra * intra_2, inter * inter_2).max(1).tolist()
        lat = self.base_latency_s + self.per_peer_latency_s * (R - 1)
        return lat + D, lat + Cb

    def _fetch(
        self, weights: tuple[np.ndarray, np.ndarray], data: tuple[np.ndarray, np.ndarray]
    ) -> tuple[float, float]:
        """Seconds until every fetched weight has arrived: alone on the links, and sharing
        them with dispatch (``(0, 0)`` when nothing is fetched). ``weights`` and ``data``
        are the busiest-link copies and rows per rank (:meth:`_busiest`)."""
        w_intra, w_inter = weights
        if not (w_intra.any() or w_inter.any()):
            return 0.0, 0.0
        alone = float(np.maximum(w_intra * self.copy_s_intra, w_inter * self.copy_s_inter).max())
        # dispatch rows and weights share each link direction: their times add
        d_intra, d_inter = data
        intra = d_intra * self.dispatch_row_s_intra + w_intra * self.copy_s_intra
        inter = d_inter * self.dispatch_row_s_inter + w_inter * self.copy_s_inter
        shared = max(alone, float(np.maximum(intra, inter).max()))
        return self.base_latency_s + alone, self.base_latency_s + shared

    def step_time(
        self,
        rows_ER: Any,
        sent_RE: Any,
        fetch_ER: Any,
        src_E: Any,
        *,
        planned: float = 1,
        traffic: Traffic | None = None,
    ) -> StepTime:
        """Predicted :class:`StepTime` of one step (module docstring).

        Args:
            rows_ER: int64 ``[E, R]`` (torch on any device, or numpy).
            sent_RE: int64 ``[R, E]`` with ``sent_RE.sum(0) == rows_ER.sum(1)``.
            fetch_ER: bool ``[E, R]``.
            src_E: int64 ``[E]``.
            planned: planner runs on the critical path.
            traffic: the dispatch rows by link under :attr:`dispatch` (required unless it
                is ``"record"``, whose rows follow from ``sent_RE`` and ``rows_ER``).
        """
        rows, sent, src = host_int64(rows_ER), host_int64(sent_RE), host_int64(src_E)
        fetch = host_bool(fetch_ER)
        E, R = rows.shape
        if fetch.shape != (E, R) or src.shape != (E,):
            raise ValueError(
                f"fetch_ER must be [E, R] = {(E, R)} and src_E [E]; got "
                f"{tuple(fetch.shape)} and {tuple(src.shape)}"
            )
        G = self.domain_size(R)
        if traffic is None and self.dispatch != "record":
            raise ValueError(f"dispatch={self.dispatch!r} needs traffic= (scheme_traffic)")
        data = dispatch_traffic(sent, rows, G) if traffic is None else traffic
        plan = self.plan_s * planned
        d_busy = self._busiest(data)
        D, Cb = self._dispatch_combine(R, d_busy)
        # both expert sections from sums over all rows and over the few fetched pairs (a
        # pair's rows are in exactly one section, and padding 0 rows gives 0)
        rows_R = rows.sum(0)
        padded_R = rows_R if self.tile_rows == 1 else self._padded(rows).sum(0)
        all_3R = (padded_R, (rows > 0).sum(0), rows_R)
        e_C, r_C = fetch.nonzero()
        if not len(e_C):  # nothing fetched: no wait section, no copy (``_fetch``'s (0, 0))
            home_R, wait_R = self._roofline(*all_3R), np.zeros(R)
            return self._schedule(plan, D, Cb, (home_R, wait_R), (0.0, 0.0))
        w_C = rows[e_C, r_C]
        wait_3R = [np.bincount(r_C, v_C, minlength=R) for v_C in (self._padded(w_C), w_C > 0, w_C)]
        moves = pair_traffic(np.stack([src[e_C], r_C], axis=1), R, G)
        beside = copies_beside(moves) if self.overlap else None
        padded, busy, rows_home = (a - w for a, w in zip(all_3R, wait_3R, strict=True))
        home_R = self._roofline(padded, busy, rows_home, beside)
        wait_R = self._roofline(*wait_3R)
        alone, ready = self._fetch(self._busiest(moves), d_busy)
        return self._schedule(plan, D, Cb, (home_R, wait_R), (alone, ready))

    def _schedule(
        self,
        plan: float,
        D: float,
        Cb: float,
        sections: tuple[np.ndarray, np.ndarray],
        fetch: tuple[float, float],
    ) -> StepTime:
        """The step's phases from its parts (module docstring): planning, dispatch and
        combine seconds, each rank's home and fetched expert ``sections`` (float64
        ``[R]``) and the fetch's ``(alone, ready)`` seconds (:meth:`_fetch`)."""
        home_R, wait_R = sections
        alone, ready = fetch
        experts = float((home_R + wait_R).max())
        without = plan + D + experts + Cb
        if self.overlap:
            total = plan + float((np.maximum(D + home_R, ready) + wait_R).max()) + Cb
        else:
            total = without + alone
        return StepTime(plan, alone, max(0.0, total - without), D, experts, Cb, total)

    def plan_time(self, plan: PlanTensors, *, planned: float = 1) -> StepTime:
        """Deprecated (it warns; removed in the next release): use
        ``moonplan.plan.plan_time.plan_time(cost, plan, planned=...)``, the same figures."""
        warn_moved("StepCost.plan_time(plan)", "plan_time(cost, plan)")
        return self.step_time(*step_inputs(plan), planned=planned)


def copies_beside(moves: Traffic) -> np.ndarray:
    """int64 ``[R]``: weight copies each rank sends or receives (``moves``: their traffic;
    a copy to the rank itself is no copy)."""
    return moves.send_intra_R + moves.send_inter_R + moves.recv_intra_R + moves.recv_inter_R
