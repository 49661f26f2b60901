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
from typing import Any

import torch

from moonplan.cli.args import (
    add_layer_args,
    add_subcommand,
    check_layer_args,
    fail,
    int_range,
)
from moonplan.runtime.routers import softmax_topk
from moonplan.tables import render
from moonplan.traces.drift import drift_log_popularity, start_log_popularity

PHASES = ("plan", "prefetch", "dispatch", "experts", "combine")
RTOL, ATOL = 1e-5, 1e-6  # the check's tolerance (module docstring)
MAX_RANKS = 256  # one forked process per rank


HELP = "run a skewed MoE layer on CPU ranks and check it"


def register(subparsers: Any) -> None:
    """Add the ``demo`` subcommand (handler in ``args.func``)."""
    p = add_subcommand(subparsers, "demo", handler, HELP)
    p.add_argument(
        "--ep",
        "--ranks",
        dest="ranks",
        type=int_range(1, MAX_RANKS),
        default=None,
        help="EP size: ranks to start (default 4; under torchrun: its WORLD_SIZE)",
    )
    add_layer_args(
        p, experts_help="experts (default 16)", topk_help="top-k, <= experts (default 2)"
    )
    p.add_argument("--steps", type=int_range(1), default=5, help="steps (default 5)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


DEMO_RHO = 0.99
"""Step-to-step correlation of the demo's drifting popularity."""


def _popularity_bias(cfg: dict, step: int) -> torch.Tensor:
    """float32 ``[E]`` log-popularity added to the router logits at ``step``: lognormal,
    AR(1)-drifting over steps (``traces.drift``, ``rho = DEMO_RHO``)."""
    g = torch.Generator().manual_seed(cfg["seed"])
    x_E = start_log_popularity(cfg["experts"], cfg["sigma"], g, torch.float32)
    for _ in range(step):
        x_E = drift_log_popularity(x_E, cfg["sigma"], DEMO_RHO, g)
    return x_E


def _step_tokens(cfg: dict, step: int, sizes: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * cfg["seed"] + step)
    return torch.randn(sum(sizes), cfg["hidden"], generator=g)


def _rank_main(
    rank: int, world: int, cfg: dict, sizes: list[int], group: Any = None, what: str = "ranks"
) -> dict:
    """One rank: run the steps; return its outputs and (on rank 0) the step figures.

    ``group``: the layer's group (default: the default process group). Rank 0 reports
    each step on stderr (``what`` names the run) unless ``cfg["progress"]`` is false.
    """
    from moonplan import MoonMoE
    from moonplan.simulate.progress import ProgressBar

    bar = ProgressBar(description=f"demo {what}") if rank == 0 and cfg["progress"] else None
    torch.manual_seed(cfg["seed"])
    state: dict[str, Any] = {}

    def router(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # fp64 then fp32: the same logits bits whatever the number of rows (see above)
        w = state["layer"].router.weight.double()
        logits = torch.nn.functional.linear(x.double(), w).float()
        return softmax_topk(logits + state["bias"], cfg["topk"])

    layer = MoonMoE(
        cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["topk"], router=router, group=group
    )
    g = torch.Generator().manual_seed(cfg["seed"] + 7)
    E, H, F = cfg["experts"], cfg["hidden"], cfg["ffn"]
    layer.load_dense(
        torch.randn(E, H, generator=g) * H**-0.5,
        torch.randn(E, 2 * F, H, generator=g) * H**-0.5,
        torch.randn(E, H, F, generator=g) * F**-0.5,
    )
    state["layer"] = layer
    first = sum(sizes[:rank])
    outs, stats = [], []
    for step in range(cfg["steps"]):
        state["bias"] = _popularity_bias(cfg, step)
        x = _step_tokens(cfg, step, sizes)[first : first + sizes[rank]].to(layer.group.device)
        with torch.no_grad():
            outs.append(layer(x).cpu())
        stats.append(layer.last_stats)
        if bar is not None:
            bar(step + 1, cfg["steps"], f"step {step + 1}")
    return {"outs": outs, "stats": stats if rank == 0 else None}


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
        _rank_main, R, cfg, sizes,
        command="moonplan demo", what=_what(args), device=args.device, timeout=args.timeout,
    )  # fmt: skip
    if ranks is None:  # a launched rank other than 0: rank 0 reports
        return 0
    print(_table(ranks[0]["stats"], cfg), flush=True)
    # the reference: the same layer in this process alone (a one-rank group, no torch.distributed)
    local = EPGroup(None, device="cuda" if args.device == "cuda" else "cpu")
    single = _rank_main(0, 1, cfg, [sum(sizes)], local, "check")["outs"]
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
