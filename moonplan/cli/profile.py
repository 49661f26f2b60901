"""``moonplan profile``: time every phase of the demo MoE model on several ranks.

Legend: R ranks, E experts, H hidden, F ffn, K top-k, S tokens of a rank, T trace steps.

Starts ``--ep`` processes (fork; gloo on CPU, NCCL with ``--device cuda``), or, under
``torchrun`` (``WORLD_SIZE`` set, any number of hosts), runs in the launched processes
(see :mod:`moonplan.cli.launch`; rank 0 prints and writes). Every rank runs
:func:`moonplan.cli.profile_ranks.rank_main`: it builds the demo's skewed ``MoonMoE``
(``--layers`` of them, stacked with residual connections), runs ``--warmup`` steps,
then ``--steps`` steps inside :func:`moonplan.profiling.session.profiling` (forward,
and backward with ``--backward``).
With ``--trace FILE`` (counts ``[T, R, E]`` or ``[R, E]`` as written by
``moonplan.traces.save_counts``) each step routes exactly the recorded counts
instead. Prints the table (per phase the slowest rank's p50/p90/mean, share of the
step, rank imbalance) and writes ``profile.json``, ``profile_trace.json``
(chrome://tracing, Perfetto) and ``profile_phases.png`` (needs matplotlib) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moonplan.cli.args import (
    add_layer_args,
    add_steps,
    add_subcommand,
    check_layer_args,
    fail,
    int_range,
)

if TYPE_CHECKING:
    import torch

HELP = "time every MoE phase per rank (table, JSON, trace)"
DESCRIPTION = (
    "Time every phase of the demo MoE model's steps on --ep ranks (forked on this host, "
    "or those torchrun launched): print the table of the slowest rank's phases and write "
    "profile.json, profile_trace.json and profile_phases.png to --out."
)


def register(subparsers: Any) -> None:
    """Add the ``profile`` subcommand (handler in ``args.func``)."""
    p = add_subcommand(subparsers, "profile", handler, HELP, DESCRIPTION)
    add_steps(
        p,
        default=10,
        help="profiled steps (default 10)",
        warmup=(2, "steps run before profiling (default 2)"),
    )
    p.add_argument(
        "--backward",
        action="store_true",
        help="also run (and time) the backward (default: forward only)",
    )
    p.add_argument(
        "--aligned",
        action="store_true",
        help="a barrier before every step's forward and backward (default: none)",
    )
    p.add_argument(
        "--out",
        default="moonplan-profile",
        help="folder for profile.json, profile_trace.json and profile_phases.png "
        "(default moonplan-profile, in the current folder)",
    )
    p.add_argument(
        "--trace",
        default=None,
        help="replay recorded counts [T, R, E] (.npy/.json; default: generated routing)",
    )
    p.add_argument("--layers", type=int_range(1), default=1, help="stacked MoE layers (default 1)")
    add_layer_args(
        p,
        ranks_help="EP size: ranks (default 4, the trace's, or torchrun's WORLD_SIZE)",
        experts_help="experts (default 16; trace: its E)",
        topk_help="top-k (default 2)",
    )


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
    from moonplan.cli.profile_ranks import rank_main

    try:
        trace = _load_trace(args) if args.trace else None
        R = _resolve_ranks(args, trace)  # >= 1: argparse, the trace file and torchrun say so
        check_layer_args(args.device, args.topk, None if trace is not None else args.experts)
    except ValueError as exc:
        return fail("moonplan profile", str(exc))
    cfg = _config(args, trace)
    got = run_and_announce(
        rank_main, R, cfg, trace,
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
