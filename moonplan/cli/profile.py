"""``moonplan profile``: time every phase of the demo MoE model on several ranks.

Legend: R ranks, E experts, H hidden, F ffn, K top-k, S tokens of a rank, T trace steps.

Starts ``--ep`` processes (fork; gloo on CPU, NCCL with ``--device cuda``), or, under
``torchrun`` (``WORLD_SIZE`` set, any number of hosts), runs in the launched processes
(see :mod:`moonplan.cli.launch`; rank 0 prints and writes),
builds the demo's skewed ``MoonMoE`` (``--layers`` of them, stacked with residual
connections), runs ``--warmup`` steps, then ``--steps`` steps inside
:func:`moonplan.profiling.session.profiling` (forward, and backward with ``--backward``).
With ``--trace FILE`` (counts ``[T, R, E]`` or ``[R, E]`` as written by
``moonplan.traces.save_counts``) each step routes exactly the recorded counts
instead. Prints the table (p50/p90 of the critical path per phase, share of the
step, rank imbalance) and writes ``profile.json``, ``profile_trace.json``
(chrome://tracing, Perfetto) and ``profile_phases.png`` (needs matplotlib) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from moonplan.cli.args import (
    add_layer_args,
    add_subcommand,
    check_layer_args,
    fail,
    int_range,
)
from moonplan.cli.demo import _popularity_bias, _step_tokens
from moonplan.runtime.routers import softmax_topk

HELP = "time every MoE phase per rank (table, JSON, trace)"


def register(subparsers: Any) -> None:
    """Add the ``profile`` subcommand (handler in ``args.func``)."""
    p = add_subcommand(subparsers, "profile", handler, HELP)
    p.add_argument(
        "--ep", "--ranks", dest="ranks", type=int_range(1), default=None,
        help="EP size: ranks (default 4, the trace's, or torchrun's WORLD_SIZE)",
    )  # fmt: skip
    p.add_argument("--steps", type=int_range(1), default=10, help="profiled steps (default 10)")
    p.add_argument(
        "--warmup", type=int_range(0), default=2, help="steps run before profiling (default 2)"
    )
    p.add_argument("--backward", action="store_true", help="also run (and time) the backward")
    p.add_argument("--aligned", action="store_true", help="barrier before every step's phases")
    p.add_argument("--out", default="moonplan-profile", help="output folder")
    p.add_argument("--trace", default=None, help="replay recorded counts (.npy/.json) [T, R, E]")
    p.add_argument("--layers", type=int_range(1), default=1, help="stacked MoE layers (default 1)")
    add_layer_args(
        p, experts_help="experts (default 16; trace: its E)", topk_help="top-k (default 2)"
    )


# ---- what every rank runs -------------------------------------------------------------------
def ids_from_counts(counts_E: torch.Tensor, topk: int) -> torch.Tensor:
    """int64 ``[S, K]`` expert ids whose counts are exactly ``counts_E`` (``S = sum / K``).

    Records are laid out expert by expert and dealt column-wise, so a token's ``K``
    picks are distinct whenever no expert has more than ``S`` records.
    """
    flat = torch.repeat_interleave(torch.arange(counts_E.numel()), counts_E.cpu())
    return flat.view(topk, -1).t().contiguous()


def _build_layers(cfg: dict, state: dict[str, Any]) -> list[torch.nn.Module]:
    from moonplan import MoonMoE

    E, H, F, K = cfg["experts"], cfg["hidden"], cfg["ffn"], cfg["topk"]
    layers: list[torch.nn.Module] = []
    for i in range(cfg["layers"]):
        router = _trace_router(state, i) if cfg["traced"] else _skew_router(state, i, K)
        layer = MoonMoE(H, F, E, K, router=router, max_tokens=cfg["tokens"])
        g = torch.Generator().manual_seed(cfg["seed"] + 7 + i)
        layer.load_dense(
            torch.randn(E, H, generator=g) * H**-0.5,
            torch.randn(E, 2 * F, H, generator=g) * H**-0.5,
            torch.randn(E, H, F, generator=g) * F**-0.5,
        )
        layers.append(layer)
    state["layers"] = layers
    return layers


def _skew_router(state: dict[str, Any], i: int, K: int) -> Any:
    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(state["layers"][i].router(x) + state["bias"], K)

    return route


def _trace_router(state: dict[str, Any], i: int) -> Any:
    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids_SK = state["ids"]
        w_SK = torch.softmax(state["layers"][i].router(x).float(), -1).gather(1, ids_SK)
        return ids_SK, (w_SK / w_SK.sum(1, keepdim=True).clamp_min(1e-20)).to(x.dtype)

    return route


def _inputs(cfg: dict, trace: torch.Tensor | None, step: int, rank: int, world: int) -> Any:
    """This rank's tokens ``[S, H]`` of ``step``; sets the routing state's input."""
    if trace is None:
        sizes = [cfg["tokens"]] * world
        first = cfg["tokens"] * rank
        return _step_tokens(cfg, step, sizes)[first : first + cfg["tokens"]], None
    ids_SK = ids_from_counts(trace[step % trace.shape[0], rank], cfg["topk"])
    g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + step * 1009 + rank)
    return torch.randn(ids_SK.shape[0], cfg["hidden"], generator=g), ids_SK


def _run_step(cfg: dict, trace: Any, state: dict[str, Any], step: int, rank: int, world: int):
    layers = state["layers"]
    dev = layers[0].group.device
    x, ids = _inputs(cfg, trace, step, rank, world)
    state["ids"] = None if ids is None else ids.to(dev)
    if trace is None:
        state["bias"] = _popularity_bias(cfg, step).to(dev)
    h = x.to(dev)
    with torch.set_grad_enabled(cfg["backward"]):
        for layer in layers:
            h = h + layer(h)
        if cfg["backward"]:
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            h.float().square().mean().backward()


def _rank_main(rank: int, world: int, cfg: dict, trace: torch.Tensor | None) -> Any:
    """One rank: warm up, profile ``steps`` steps; rank 0 returns the ProfileReport."""
    from moonplan.profiling.session import profiling

    torch.manual_seed(cfg["seed"])
    state: dict[str, Any] = {}
    layers = _build_layers(cfg, state)
    for step in range(cfg["warmup"]):
        _run_step(cfg, trace, state, step, rank, world)
    with profiling(layers, aligned=cfg["aligned"]) as prof:
        for step in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
            _run_step(cfg, trace, state, step, rank, world)
    return prof.report if rank == 0 else None


_CONFIG_KEYS = (
    *("experts", "tokens", "topk", "hidden", "ffn", "sigma", "seed"),
    *("steps", "warmup", "backward", "aligned", "layers"),
)


# ---- the command --------------------------------------------------------------------------
def _load_trace(args: argparse.Namespace) -> torch.Tensor:
    """Counts ``[T, R, E]`` of ``--trace``; raises ValueError on a bad file."""
    from moonplan.traces import load_counts

    counts = load_counts(args.trace)
    counts_TRE = counts if counts.dim() == 3 else counts.unsqueeze(0)
    bad = counts_TRE.sum(2) % args.topk
    if bool(bad.any()):
        raise ValueError(f"every rank's records in {args.trace} must be a multiple of --topk")
    return counts_TRE


def _config(args: argparse.Namespace, trace: torch.Tensor | None) -> dict:
    cfg = {k: getattr(args, k) for k in _CONFIG_KEYS}
    cfg["traced"] = trace is not None
    if trace is not None:
        cfg["experts"] = int(trace.shape[2])
        cfg["tokens"] = int(trace.sum(2).max()) // args.topk
    return cfg


def _resolve_ranks(args: argparse.Namespace, trace: torch.Tensor | None) -> int:
    from moonplan.cli.launch import resolve_world_size

    if trace is None:
        return resolve_world_size(args.ranks, 4)
    R = int(trace.shape[1])
    if args.ranks is not None and args.ranks != R:
        raise ValueError(f"--ep {args.ranks} differs from the trace's {R} ranks")
    return resolve_world_size(R, R)


def write_outputs(report: Any, cfg: dict, out: Path) -> list[str]:
    """Write JSON, Chrome trace and PNG to ``out``; returns what was written (or skipped)."""
    from moonplan.profiling.chrome import write_chrome_trace
    from moonplan.profiling.plot import plot_phase_bars

    out.mkdir(parents=True, exist_ok=True)
    path = out / "profile.json"
    path.write_text(json.dumps({"config": cfg, **report.to_json()}, indent=1) + "\n")
    lines = [f"wrote {path}", f"wrote {write_chrome_trace(report, out / 'profile_trace.json')}"]
    try:
        lines.append(f"wrote {plot_phase_bars(report, out / 'profile_phases.png')}")
    except ImportError as exc:
        lines.append(f"skipped the PNG: {exc}")
    return lines


def _what(args: argparse.Namespace, cfg: dict) -> str:
    """The run, as the banner names it (``cfg["experts"]``: E of the trace, if any)."""
    source = f"trace {args.trace}" if args.trace else f"lognormal sigma={args.sigma}"
    passes = "forward+backward" if args.backward else "forward"
    layers = f"{args.layers} layer(s) E={cfg['experts']} H={args.hidden} F={args.ffn}"
    steps = f"{args.warmup} warm-up + {args.steps} steps"
    return f"{layers} K={args.topk}, {source}, {steps}, {passes}"


def handler(args: argparse.Namespace) -> int:
    """Run the profile; 0 on success, 2 on bad arguments."""
    from moonplan.cli.launch import run_and_announce

    try:
        trace = _load_trace(args) if args.trace else None
        R = _resolve_ranks(args, trace)  # >= 1: argparse, the trace file and torchrun say so
        check_layer_args(args.device, args.topk, None if trace is not None else args.experts)
    except ValueError as exc:
        return fail("moonplan profile", str(exc))
    cfg = _config(args, trace)
    got = run_and_announce(
        _rank_main, R, cfg, trace,
        command="moonplan profile", what=_what(args, cfg), device=args.device,
        timeout=args.timeout,
    )  # fmt: skip
    if got is None:  # a launched rank other than 0: rank 0 reports
        return 0
    report = got[0]
    print(report.table())
    for line in write_outputs(report, cfg, Path(args.out)):
        print(line)
    return 0
