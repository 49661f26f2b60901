"""``moonplan demo``: the planner on a drifting, skewed routing trace, step by step.

For each step it plans with and without resident slots, routes every rank's
records (all ranks simulated in this process), verifies every invariant and
that every receive position is written exactly once, and prints static-EP
against moonplan load, copies, bytes prefetched and planning time. Exits
non-zero on any violation. (The multi-process runtime demo builds on this.)
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

import moonplan
from moonplan.baselines import moonep_greedy_alloc, replica_count
from moonplan.traces import DriftingTrace, sample_topk


def register(subparsers: Any) -> None:
    """Add the ``demo`` subcommand (handler in ``args.func``)."""
    p = subparsers.add_parser("demo", help="run the planner demo on a skewed, drifting trace")
    p.add_argument("--ranks", type=int, default=4, help="EP ranks (default 4)")
    p.add_argument("--experts", type=int, default=16, help="experts (default 16)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank (default 512)")
    p.add_argument("--topk", type=int, default=2, help="top-k (default 2)")
    p.add_argument("--hidden", type=int, default=1024, help="H, for prefetch bytes (default 1024)")
    p.add_argument("--ffn", type=int, default=2048, help="F, for prefetch bytes (default 2048)")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal skew (default 1)")
    p.add_argument("--steps", type=int, default=6, help="steps (default 6)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--device", default="cpu", help="device for the plan tensors (default cpu)")
    p.set_defaults(func=handler)


def verify_routing(plan: moonplan.Plan, ids_per_rank: list[torch.Tensor]) -> None:
    """Route every rank; raise unless every valid receive row is written exactly once."""
    writes_R = [torch.zeros(int(n), dtype=torch.int64) for n in plan.recv_size().tolist()]
    for s, ids_SK in enumerate(ids_per_rank):
        rt = moonplan.route(plan, s, ids_SK.to(plan.device))
        for d, o in zip(
            rt.dest_rank.reshape(-1).tolist(), rt.dest_offset.reshape(-1).tolist(), strict=True
        ):
            writes_R[d][o] += 1
    for r in range(plan.num_ranks):
        want = torch.zeros_like(writes_R[r])
        for w in range(plan.num_rows):
            start = int(plan.row_offset[r, w])
            want[start : start + int(plan.row_count[r, w])] = 1
        if not torch.equal(writes_R[r], want):
            raise moonplan.PlanError(f"rank {r}: receive rows not written exactly once")


def _step_ids(
    trace: DriftingTrace, tokens: int, topk: int, gen: torch.Generator
) -> list[torch.Tensor]:
    pop_E = torch.softmax(trace.log_pop_E, 0)
    return [sample_topk(pop_E, tokens, topk, gen) for _ in trace.tokens_R]


def handler(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every step checks out, 1 otherwise."""
    trace = DriftingTrace(
        args.ranks, args.experts, args.tokens, args.topk, sigma=args.sigma, seed=args.seed
    )
    gen = torch.Generator().manual_seed(args.seed + 1)
    expert_bytes = 3 * args.hidden * args.ffn * 2  # bf16 gate, up and down
    print(
        f"moonplan demo: R={args.ranks} E={args.experts} S={args.tokens} K={args.topk} "
        f"lognormal sigma={args.sigma}, {args.steps} steps "
        "(planner + routing, all ranks in-process)"
    )
    print(
        f"{'step':>4} {'static max/mean':>15} {'moonplan':>9} {'copies':>7} {'greedy':>7} "
        f"{'new (resident)':>15} {'prefetch MiB':>13} {'plan ms':>8}"
    )
    prev, ok = None, True
    for step in range(args.steps):
        ids = _step_ids(trace, args.tokens, args.topk, gen)
        trace.step()  # advance the drift for the next step
        counts_RE = torch.stack(
            [torch.bincount(x.reshape(-1), minlength=args.experts) for x in ids]
        )
        counts_RE = counts_RE.to(args.device)
        t0 = time.perf_counter()
        plan = moonplan.plan(counts_RE, previous=prev)
        ms = (time.perf_counter() - t0) * 1e3
        try:
            moonplan.check_plan(plan, counts_RE, previous=prev)
            verify_routing(plan, ids)
        except moonplan.PlanError as exc:
            print(f"step {step}: FAILED: {exc}", file=sys.stderr)
            ok = False
        s = plan.summary()
        greedy = replica_count(moonep_greedy_alloc(counts_RE))
        print(
            f"{step:>4} {s['static_max_over_mean']:>15.3f} {s['planned_max_over_mean']:>9.3f} "
            f"{s['copies']:>7} {greedy:>7} {s['new_copies']:>15} "
            f"{s['new_copies'] * expert_bytes / 2**20:>13.1f} {ms:>8.2f}"
        )
        prev = plan
    print("all invariants hold; every receive row written exactly once" if ok else "MISMATCH")
    return 0 if ok else 1
