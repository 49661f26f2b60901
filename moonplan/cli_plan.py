"""``moonplan plan``: plan one step's counts and print per-rank loads before and after.

Counts come from a file (``.json`` or ``.npy``, shape ``[R, E]``; a ``[T, R, E]``
trace takes ``--step``) or are generated (``--family lognormal --sigma 1 ...``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

import moonplan
from moonplan.baselines import copies_lower_bound, moonep_greedy_alloc, replica_count
from moonplan.cli_args import fail, float_range, int_range
from moonplan.plan.api import BACKENDS


def register(subparsers: Any) -> None:
    """Add the ``plan`` subcommand (handler in ``args.func``)."""
    p = subparsers.add_parser(
        "plan",
        help="plan one step's router counts and print per-rank loads before/after",
        description="Plan exact balance for router counts [R, E] read from a file or generated.",
    )
    p.add_argument("counts", nargs="?", help="counts file (.json or .npy), [R,E] or [T,R,E]")
    p.add_argument(
        "--step", type=int_range(0), default=0, help="step of a [T,R,E] trace file (default 0)"
    )
    p.add_argument("--family", default="lognormal", help="generated family (default lognormal)")
    p.add_argument("--sigma", type=float_range(0), default=1.0, help="lognormal sigma (default 1)")
    p.add_argument(
        "--ranks", type=int_range(1), default=8, help="R for generated counts (default 8)"
    )
    p.add_argument(
        "--experts", type=int_range(1), default=64, help="E for generated counts (default 64)"
    )
    p.add_argument(
        "--tokens", type=int_range(0), default=4096, help="tokens per rank (default 4096)"
    )
    p.add_argument("--topk", type=int_range(1), default=8, help="top-k (default 8)")
    p.add_argument("--seed", type=int_range(0), default=0, help="seed (default 0)")
    p.add_argument(
        "--slots", type=int_range(0), default=None, help="prefetch slots B (default ceil(E/R))"
    )
    p.add_argument("--align", type=int_range(1), default=1, help="row padding (default 1)")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="planner backend")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=handler)


def load_or_generate(args: argparse.Namespace) -> torch.Tensor:
    """The ``[R, E]`` counts the arguments describe."""
    from moonplan.traces import generate_counts, load_counts

    if args.counts:
        counts = load_counts(args.counts)
        if counts.dim() == 3:
            if not 0 <= args.step < counts.shape[0]:
                raise ValueError(f"--step {args.step} outside the trace's {counts.shape[0]} steps")
            counts = counts[args.step]
        return counts
    return generate_counts(
        args.family,
        ranks=args.ranks,
        experts=args.experts,
        tokens=args.tokens,
        topk=args.topk,
        seed=args.seed,
        sigma=args.sigma,
    )


def handler(args: argparse.Namespace) -> int:
    """Run ``moonplan plan``; returns the exit status."""
    if args.backend == "cuda":
        from moonplan.plan.cuda_backend import available

        ok, why = available()
        if not ok:
            return fail("moonplan plan", f"--backend cuda is unavailable here: {why}")
    try:
        counts_RE = load_or_generate(args)
        plan = moonplan.plan(counts_RE, slots=args.slots, align=args.align, backend=args.backend)
        moonplan.check_plan(plan, counts_RE)
    except (ValueError, OSError) as exc:
        return fail("moonplan plan", str(exc))
    summary = plan.summary()
    summary["moonep_greedy_copies"] = replica_count(moonep_greedy_alloc(counts_RE))
    summary["copies_lower_bound"] = copies_lower_bound(counts_RE)
    print(json.dumps(summary) if args.json else format_plan_table(summary))
    return 0


def format_plan_table(s: dict[str, Any]) -> str:
    """Per-rank table and totals of a :meth:`Plan.summary` (plus baseline copies)."""
    lines = [
        f"R={s['ranks']} E={s['experts']} slots B={s['slots']} records N={s['records']}",
        f"{'rank':>5} {'static load':>12} {'planned load':>13} {'remote experts':>15}",
    ]
    rows = zip(s["static_load"], s["planned_load"], s["remote_experts"], strict=True)
    for r, (st, pl, rem) in enumerate(rows):
        lines.append(f"{r:>5} {st:>12} {pl:>13} {rem:>15}")
    lines += [
        f"max/mean load: static EP {s['static_max_over_mean']:.3f} -> "
        f"moonplan {s['planned_max_over_mean']:.3f}",
        f"copies: moonplan {s['copies']} (direct {s['direct']}), "
        f"MoonEP greedy {s['moonep_greedy_copies']}, lower bound {s['copies_lower_bound']}",
        f"remote experts per rank: max {s['max_remote_experts']} "
        f"(bound ceil(E/R) = {s['remote_bound']})",
    ]
    return "\n".join(lines)
