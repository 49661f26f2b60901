"""Two published trends, reproduced (as trends, not figures) by the step-time model.

Legend: R ranks (GPUs), E experts, S tokens per GPU.

* **DeepSpeed-MoE §5.5.1**: its 128-expert 1.3B+MoE-128 model, moved from 8 to 64
  GPUs, gains *per-GPU* throughput (super-linear scaling) because each GPU holds
  and reads fewer expert weights (16 -> 2 experts per GPU) while the batch is small
  and the MoE layer is bound by weight reads. :func:`deepspeed_trend` runs static
  EP at a fixed ``S`` per GPU (weak scaling, an assumption: the paper's batch per
  GPU is not restated here) and reports tokens per second per GPU for a whole
  forward pass (MoE layers plus the non-MoE parts, :func:`dense_time`).
* **GShard §5.2**: from 128 to 2048 experts (one per device) the dispatch+combine
  share of the MoE+Transformer time grows from 16% to 36%. :func:`gshard_trend`
  reports the all-to-all share of one MoE layer plus its share of the non-MoE
  time, at fixed ``S`` per device; the growth comes from the per-peer latency of
  the all-to-all and from more traffic leaving the NVLink domain (GShard ran on
  TPU v3 cores, so only the direction and rough size of the change carry over).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

from moonplan.cost import ModelPreset
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import DEEPSPEED_MOE_128, gshard_model
from moonplan.simulate.sweep import simulate_trace
from moonplan.simulate.workload import drifting_counts
from moonplan.stepcost.hardware import Hardware, get_hardware

Progress = Callable[[int, int, str], None]


def dense_time(model: ModelPreset, hw: Hardware, tokens: int, cfg: SimConfig) -> float:
    """Seconds of the non-MoE weights of one forward pass on one rank (roofline per layer).

    Per layer the attention projections; per dense layer its FFN (``3*H*F_dense``); per
    MoE layer the shared experts and the router. Each layer costs
    ``max(2*S*params / FLOP rate, params*weight_bytes / HBM)``; attention's
    sequence-quadratic part, norms, embedding and LM head are left out.
    """
    H = model.hidden_size
    layers = [model.attention.params(H)] * model.num_layers
    layers += [3 * H * model.dense_intermediate_size] * model.num_dense_layers
    shared = 3 * H * model.moe_intermediate_size * model.num_shared_experts
    layers += [shared + H * model.num_experts] * model.num_moe_layers
    return sum(
        max(2.0 * tokens * p / hw.flops, p * cfg.weight_bytes / hw.hbm_bytes_per_s) for p in layers
    )


class TrendOptions(TypedDict, total=False):
    """Keyword options both trends take (each trend's docstring gives its defaults):
    ``hardware`` preset, ``tokens`` per rank, simulator ``cfg``, trace ``seed`` and a
    ``progress(done, total, label)`` callback."""

    hardware: str
    tokens: int
    cfg: SimConfig | None
    seed: int
    progress: Progress | None


@dataclass(frozen=True)
class _Run:
    """A trend's resolved options, and the static-EP layer it simulates at each size."""

    hw: Hardware
    tokens: int
    cfg: SimConfig
    seed: int
    progress: Progress | None

    @classmethod
    def of(cls, options: TrendOptions, hardware: str, tokens: int) -> _Run:
        return cls(
            hw=get_hardware(options.get("hardware", hardware)),
            tokens=int(options.get("tokens", tokens)),
            cfg=options.get("cfg") or SimConfig(),
            seed=int(options.get("seed", 0)),
            progress=options.get("progress"),
        )

    def each(self, sizes: Sequence[int], label: str) -> Iterator[int]:
        """``sizes`` one by one, reporting ``label=<size>`` to ``progress`` before each and
        ``(total, total, "done")`` after the last (as the sweeps report)."""
        for i, n in enumerate(sizes):
            if self.progress:
                self.progress(i, len(sizes), f"{label}={n}")
            yield n
        if self.progress:
            self.progress(len(sizes), len(sizes), "done")

    def layer(self, model: ModelPreset, ranks: int, dense_layers: int = 1) -> dict[str, float]:
        """Static-EP MoE layer on near-uniform routing (lognormal sigma 0): ``moe_layer_us``,
        ``experts_us``, ``dispatch_combine_us``, and ``dense_us``, the non-MoE time of one
        forward divided by ``dense_layers``."""
        counts = drifting_counts(
            ranks, model.num_experts, self.tokens, model.top_k, sigma=0.0, steps=2, seed=self.seed
        )
        moe = simulate_trace(counts, model, self.hw, self.cfg, ["static-linear"], warmup=1)[0]
        return {
            "moe_layer_us": moe["total_us"],
            "experts_us": moe["experts_us"],
            "dispatch_combine_us": moe["dispatch_us"] + moe["combine_us"],
            "dense_us": dense_time(model, self.hw, self.tokens, self.cfg) * 1e6 / dense_layers,
        }


def deepspeed_trend(
    *, gpus: Sequence[int] = (8, 16, 32, 64), **options: Unpack[TrendOptions]
) -> list[dict[str, Any]]:
    """Per-GPU throughput of DeepSpeed-MoE's 128-expert model as the GPU count grows.

    Options (:class:`TrendOptions`): ``hardware="a100-multinode"``, ``tokens=128``,
    ``cfg=SimConfig()``, ``seed=0``, ``progress=None``.

    Returns one dict per GPU count: ``gpus``, ``experts_per_gpu``, ``moe_layer_us``,
    ``experts_us``, ``dispatch_combine_us``, ``dense_us``, ``forward_us``,
    ``tokens_per_s_per_gpu`` and ``per_gpu_speedup`` (relative to the first GPU count;
    above 1 means super-linear total throughput).
    """
    run, model = _Run.of(options, "a100-multinode", 128), DEEPSPEED_MOE_128
    rows = []
    for R in run.each(gpus, "deepspeed-moe GPUs"):
        row = {"gpus": R, "experts_per_gpu": model.num_experts / R, **run.layer(model, R)}
        forward = row["moe_layer_us"] * model.num_moe_layers + row["dense_us"]
        per_s = run.tokens / forward * 1e6
        rows.append({**row, "forward_us": forward, "tokens_per_s_per_gpu": per_s})
    for r in rows:
        r["per_gpu_speedup"] = r["tokens_per_s_per_gpu"] / rows[0]["tokens_per_s_per_gpu"]
    return rows


def gshard_trend(
    *, experts: Sequence[int] = (128, 256, 512, 1024, 2048), **options: Unpack[TrendOptions]
) -> list[dict[str, Any]]:
    """Dispatch+combine share of the MoE+Transformer time as GShard's experts grow (EP = E).

    Options (:class:`TrendOptions`): ``hardware="h200-multinode"``, ``tokens=1024``,
    ``cfg=SimConfig()``, ``seed=0``, ``progress=None``.

    Returns one dict per expert count: ``experts``, ``ranks``, ``dispatch_combine_us``,
    ``moe_layer_us``, ``experts_us``, ``dense_us`` (non-MoE time per MoE layer) and ``share``.
    """
    run = _Run.of(options, "h200-multinode", 1024)
    rows = []
    for E in run.each(experts, "gshard E"):
        model = gshard_model(E)
        row = {"experts": E, "ranks": E, **run.layer(model, E, model.num_moe_layers)}
        share = row["dispatch_combine_us"] / (row["moe_layer_us"] + row["dense_us"])
        rows.append({**row, "share": share})
    return rows
