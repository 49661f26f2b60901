"""Hardware presets for the step-time simulator, each figure with its source.

Units: bytes per second, FLOP per second, seconds. Bandwidths are *per GPU and per
direction* (NVIDIA quotes NVLink as the bidirectional sum; we halve it).

Calibration (see ``docs/simulator.md`` for the full list of assumptions):

* achievable bf16 GEMM rate: about 790 TFLOP/s for large bf16 GEMMs is the figure
  quoted for the H200 machines this project can borrow (80% of the 989 TFLOP/s
  dense peak); moonplan has not measured it yet (``docs/benchmarks.md``); the same
  80% is *assumed* for the other GPUs;
* communication efficiency: DeepEP reports 153 GB/s intranode dispatch on H800,
  whose NVLink gives 200 GB/s per direction (77%), and 43-58 GB/s over RDMA on
  400 Gb/s (50 GB/s) NICs; we use 75% of NVLink and 85% of the NIC;
* per-peer latency of an all-to-all: DeepEP's low-latency dispatch of the same
  per-rank payload (128 tokens, top-8) takes 77 us at EP8 and 194 us at EP256:
  (194 - 77) / (256 - 8) = 0.47 us per extra peer; the 10 us base is an assumption;
* expert GEMM tiles: rows are padded to 128-row tiles (Hopper wgmma tiles of the
  grouped GEMM), the per-expert efficiency loss for small row counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

TB = 1e12
GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One GPU type and its links.

    Attributes:
        name: preset name.
        hbm_bytes_per_s: HBM bandwidth (bytes/s).
        bf16_flops_peak: dense bf16 tensor-core peak (FLOP/s).
        flops_efficiency: achievable fraction of the peak on large GEMMs.
        nvlink_bytes_per_s: NVLink bandwidth per GPU per direction (bytes/s).
        nvlink_domain: GPUs sharing one NVLink domain (0: every rank, any EP size).
        net_bytes_per_s: network (NIC) bandwidth per GPU per direction (bytes/s).
        nvlink_efficiency, net_efficiency: achievable fraction of each link in all-to-all.
        base_latency_s: fixed latency of one all-to-all or one prefetch (s).
        per_peer_latency_s: extra latency per peer of an all-to-all (s).
        gemm_tile_rows: rows of one GEMM tile; an expert's rows are padded to it.
        source: where the figures come from.
    """

    name: str
    hbm_bytes_per_s: float
    bf16_flops_peak: float
    nvlink_bytes_per_s: float
    nvlink_domain: int
    net_bytes_per_s: float
    flops_efficiency: float = 0.80
    nvlink_efficiency: float = 0.75
    net_efficiency: float = 0.85
    base_latency_s: float = 10e-6
    per_peer_latency_s: float = 0.47e-6
    gemm_tile_rows: int = 128
    source: str = ""

    @property
    def flops(self) -> float:
        """Achievable bf16 FLOP/s for expert GEMMs."""
        return self.bf16_flops_peak * self.flops_efficiency

    @property
    def nvlink_effective(self) -> float:
        """Achievable NVLink bytes/s per direction."""
        return self.nvlink_bytes_per_s * self.nvlink_efficiency

    @property
    def net_effective(self) -> float:
        """Achievable network bytes/s per direction."""
        return self.net_bytes_per_s * self.net_efficiency

    def domain(self, num_ranks: int) -> int:
        """GPUs per NVLink domain for an EP group of ``num_ranks`` (>= 1)."""
        return num_ranks if self.nvlink_domain <= 0 else min(self.nvlink_domain, num_ranks)


_H200_SRC = (
    "NVIDIA H200 SXM datasheet: HBM3e 4.8 TB/s, bf16 989 TFLOP/s dense, NVLink 900 GB/s "
    "bidirectional; achievable ~790 TFLOP/s as quoted for the borrowable H200s (not yet "
    "measured by moonplan); "
    "one 400 Gb/s NIC per GPU (ConnectX-7 class)"
)
_H20_SRC = (
    "NVIDIA H20 published specs: HBM3 4.0 TB/s, bf16 148 TFLOP/s dense, NVLink 900 GB/s "
    "bidirectional; 80% achievable GEMM rate assumed; one 400 Gb/s NIC per GPU"
)
_A100_SRC = (
    "NVIDIA A100 80GB SXM datasheet: HBM2e 2.039 TB/s, bf16 312 TFLOP/s dense, NVLink "
    "600 GB/s bidirectional; DGX A100: one 200 Gb/s HDR NIC per GPU; 80% GEMM rate assumed"
)
_ALL_NVLINK = "; NVLink to every rank (exact for EP <= 8, an NVLink-rack idealisation above)"
_NODES = "; 8 GPUs per NVLink node, nodes joined by the NICs"


_H200 = Hardware(
    "h200",
    hbm_bytes_per_s=4.8 * TB,
    bf16_flops_peak=989e12,
    flops_efficiency=790 / 989,
    nvlink_bytes_per_s=450 * GB,
    nvlink_domain=0,
    net_bytes_per_s=50 * GB,
    source=_H200_SRC,
)
_H20 = dataclasses.replace(_H200, hbm_bytes_per_s=4.0 * TB, bf16_flops_peak=148e12,
                           flops_efficiency=0.80, source=_H20_SRC)  # fmt: skip
_A100 = dataclasses.replace(_H200, hbm_bytes_per_s=2.039 * TB, bf16_flops_peak=312e12,
                            flops_efficiency=0.80, nvlink_bytes_per_s=300 * GB,
                            net_bytes_per_s=25 * GB, source=_A100_SRC)  # fmt: skip


def _preset(gpu: Hardware, name: str, domain: int, note: str) -> Hardware:
    """``gpu``'s figures as the preset ``name`` with ``domain`` GPUs per NVLink domain."""
    return dataclasses.replace(gpu, name=name, nvlink_domain=domain, source=gpu.source + note)


HARDWARE: Mapping[str, Hardware] = MappingProxyType(
    {
        h.name: h
        for h in (
            _preset(_H200, "h200-node", 0, _ALL_NVLINK),
            _preset(_H200, "h200-multinode", 8, _NODES),
            _preset(_H20, "h20-node", 0, _ALL_NVLINK),
            _preset(_H20, "h20-multinode", 8, _NODES),
            _preset(_A100, "a100-multinode", 8, _NODES),
        )
    }
)
"""Read-only registry of hardware presets, keyed by name."""


def get_hardware(name: str) -> Hardware:
    """The preset called ``name`` (case-insensitive); ``ValueError`` naming the choices."""
    hw = HARDWARE.get(str(name).strip().lower())
    if hw is None:
        raise ValueError(f"unknown hardware {name!r}; valid choices: {', '.join(sorted(HARDWARE))}")
    return hw
