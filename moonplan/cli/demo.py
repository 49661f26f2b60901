"""``moonplan demo``: a skewed MoE layer on several CPU ranks, checked against one process.

Starts ``--ep`` processes (fork, gloo; ``--device cuda`` for NCCL), or, under
``torchrun`` (``WORLD_SIZE`` set, any number of hosts), runs in the launched processes
(see :mod:`moonplan.cli.launch`). Builds the
same small ``MoonMoE`` on each, routes tokens with lognormal-skewed, slowly
drifting expert popularity for a few steps, and prints per step the static-EP
max/mean load against moonplan's, copies, weights prefetched and phase times.
Then it runs the same layer in a single process on all tokens and checks every
rank's output against it; exits non-zero on any mismatch. Rank 0 reports progress
with an ETA on stderr.

The check is a tolerance, not bit equality: ``|got - want| <= ATOL + RTOL * |want|``
elementwise (``torch.allclose``, ``RTOL = 1e-5``, ``ATOL = 1e-6``). The ranks run the
same fp32 matrix products as the single process, but on fewer rows at a time (each
rank's own tokens, an expert's records split between its home and its replicas),
and CPU BLAS blocks a product by its row count, so sums are added in another order:
outputs differ in the last bits (measured: up to a few 1e-7 absolute on outputs of
order 1). The router's logits are computed in fp64 and rounded to fp32, which makes
them, and hence the top-k choice, the same in both runs (a top-k flip would be a
real mismatch). See ``docs/reliability.md``.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from moonplan.cli.args import (
    add_layer_args,
    add_steps,
    add_subcommand,
    check_layer_args,
    fail,
)
from moonplan.tables import render

if TYPE_CHECKING:
    import torch

PHASES = ("plan", "prefetch", "dispatch", "experts", "combine")
RTOL, ATOL = 1e-5, 1e-6  # the check's tolerance (module docstring)
MAX_RANKS = 256  # one forked process per rank


HELP = "run a skewed MoE layer on CPU ranks and check it"
DESCRIPTION = (
    "Run a small MoonMoE layer with skewed, drifting routing on --ep ranks (forked on "
    "this host, or those torchrun launched), print each step's loads, copies and phase "
    "times, then check every rank's output against the same layer in one process."
)


def register(subparsers: Any) -> None:
    """Add the ``demo`` subcommand (handler in ``args.func``)."""
    p = add_subcommand(subparsers, "demo", handler, HELP, DESCRIPTION)
    add_layer_args(
        p,
        ranks_help="EP size: ranks to start (default 4; under torchrun: its WORLD_SIZE)",
        most_ranks=MAX_RANKS,
        experts_help="experts (default 16)",
        topk_help="top-k, <= experts (default 2)",
    )
    add_steps(p, default=5, help="steps (default 5)")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress lines on stderr (default: rank 0 reports each step)",
    )


def _table(stats: list, cfg: dict) -> str:
    expert_mib = 3 * cfg["hidden"] * cfg["ffn"] * 4 / 2**20  # fp32 weights moved by all ranks
    header = ["step", "static max/mean", "moonplan", "copies", "new", "prefetch MiB"]
    header += [f"{p} ms" for p in PHASES]
    rows = [
        [
            str(i),
            f"{s.static_max_over_mean:.3f}",
            f"{s.planned_max_over_mean:.3f}",
            str(s.copies),
            str(s.new_copies),
            f"{s.new_copies * expert_mib:.2f}",
            *[f"{1e3 * s.phases.get(p, 0.0):.2f}" for p in PHASES],
        ]
        for i, s in enumerate(stats)
    ]
    return render(header, rows)


def _what(args: argparse.Namespace) -> str:
    """The run, as the banner names it."""
    layer = f"E={args.experts} H={args.hidden} F={args.ffn} K={args.topk}"
    return f"{layer}, {args.tokens} tokens/rank, lognormal sigma={args.sigma}, {args.steps} steps"


def handler(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every rank matches the single-process layer, 1 otherwise."""
    import torch

    from moonplan.cli.demo_ranks import rank_main
    from moonplan.cli.launch import resolve_world_size, run_and_announce
    from moonplan.comm.group import EPGroup

    cfg = {
        k: getattr(args, k)
        for k in ("experts", "tokens", "topk", "hidden", "ffn", "sigma", "steps", "seed")
    }
    cfg["progress"] = not args.no_progress
    try:
        R = resolve_world_size(args.ranks, 4)
        check_layer_args(args.device, args.topk, args.experts)
    except ValueError as exc:
        return fail("moonplan demo", str(exc))
    sizes = [args.tokens] * R
    ranks = run_and_announce(
        rank_main, R, cfg, sizes,
        command="moonplan demo", what=_what(args), device=args.device, timeout=args.timeout,
    )  # fmt: skip
    if ranks is None:  # a launched rank other than 0: rank 0 reports
        return 0
    print(_table(ranks[0]["stats"], cfg), flush=True)
    # the reference: the same layer in this process alone (a one-rank group, no torch.distributed)
    local = EPGroup(None, device="cuda" if args.device == "cuda" else "cpu")
    single = rank_main(0, 1, cfg, [sum(sizes)], local, "check")["outs"]
    for step in range(args.steps):
        got = torch.cat([r["outs"][step] for r in ranks])
        if not torch.allclose(got, single[step], rtol=RTOL, atol=ATOL):
            diff, _ = _difference([got], [single[step]])
            print(
                f"MISMATCH at step {step}: max absolute difference {diff:.2e} exceeds "
                f"rtol={RTOL:g}, atol={ATOL:g}",
                file=sys.stderr,
            )
            return 1
    diff, scale = _difference(
        [torch.cat([r["outs"][s] for r in ranks]) for s in range(args.steps)], single
    )
    why = "fp32 sums over other row counts round differently"
    exact = "bit-identical this run" if diff == 0 else f"max absolute difference {diff:.1e}; {why}"
    print(
        f"every rank's output matches the single-process layer within rtol={RTOL:g}, "
        f"atol={ATOL:g} ({exact}; largest output {scale:.2f})"
    )
    return 0


def _difference(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[float, float]:
    """``(max |got - want|, max |want|)`` over every step's outputs."""
    pairs = [(g, w) for g, w in zip(got, want, strict=True) if w.numel()]
    diff = max((float((g - w).abs().max()) for g, w in pairs), default=0.0)
    scale = max((float(w.abs().max()) for w in want if w.numel()), default=0.0)
    return diff, scale
