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

from collections.abc import Callable, Sequence
from typing import Any

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


def _moe_row(
    model: ModelPreset, hw: Hardware, ranks: int, tokens: int, cfg: SimConfig, seed: int
) -> dict[str, Any]:
    """Static-EP MoE layer time on near-uniform routing (lognormal sigma 0)."""
    counts = drifting_counts(
        ranks, model.num_experts, tokens, model.top_k, sigma=0.0, steps=2, seed=seed
    )
    return simulate_trace(counts, model, hw, cfg, ["static-linear"], warmup=1)[0]


def _layer_times(moe: dict[str, Any], dense_us: float) -> dict[str, float]:
    """What both trends report of one MoE layer row and its non-MoE time (us)."""
    return {
        "moe_layer_us": moe["total_us"],
        "experts_us": moe["experts_us"],
        "dispatch_combine_us": moe["dispatch_us"] + moe["combine_us"],
        "dense_us": dense_us,
    }


def deepspeed_trend(
    *,
    hardware: str = "a100-multinode",
    gpus: Sequence[int] = (8, 16, 32, 64),
    tokens: int = 128,
    cfg: SimConfig | None = None,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Per-GPU throughput of DeepSpeed-MoE's 128-expert model as the GPU count grows.

    Returns one dict per GPU count: ``gpus``, ``experts_per_gpu``, ``moe_layer_us``,
    ``dense_us``, ``forward_us``, ``tokens_per_s_per_gpu`` and ``per_gpu_speedup``
    (relative to the first GPU count; above 1 means super-linear total throughput).
    """
    cfg, hw, model = cfg or SimConfig(), get_hardware(hardware), DEEPSPEED_MOE_128
    rows = []
    for i, R in enumerate(gpus):
        if progress:
            progress(i, len(gpus), f"deepspeed-moe GPUs={R}")
        moe = _moe_row(model, hw, R, tokens, cfg, seed)
        dense = dense_time(model, hw, tokens, cfg) * 1e6
        forward = moe["total_us"] * model.num_moe_layers + dense
        row = {"gpus": R, "experts_per_gpu": model.num_experts / R, **_layer_times(moe, dense)}
        rows.append({**row, "forward_us": forward, "tokens_per_s_per_gpu": tokens / forward * 1e6})
    for r in rows:
        r["per_gpu_speedup"] = r["tokens_per_s_per_gpu"] / rows[0]["tokens_per_s_per_gpu"]
    return rows


def gshard_trend(
    *,
    hardware: str = "h200-multinode",
    experts: Sequence[int] = (128, 256, 512, 1024, 2048),
    tokens: int = 1024,
    cfg: SimConfig | None = None,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Dispatch+combine share of the MoE+Transformer time as GShard's experts grow (EP = E).

    Returns one dict per expert count: ``experts``, ``ranks``, ``dispatch_combine_us``,
    ``moe_layer_us``, ``experts_us``, ``dense_us`` (non-MoE time per MoE layer) and ``share``.
    """
    cfg, hw = cfg or SimConfig(), get_hardware(hardware)
    rows = []
    for i, E in enumerate(experts):
        if progress:
            progress(i, len(experts), f"gshard E={E}")
        model = gshard_model(E)
        moe = _moe_row(model, hw, E, tokens, cfg, seed)
        dense = dense_time(model, hw, tokens, cfg) * 1e6 / model.num_moe_layers
        row = {"experts": E, "ranks": E, **_layer_times(moe, dense)}
        rows.append({**row, "share": row["dispatch_combine_us"] / (moe["total_us"] + dense)})
    return rows
