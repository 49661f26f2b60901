"""``moonplan plan``: plan one step's counts; print loads, slots, flows and the allocation.

Legend: R ranks, E experts, B slots, T steps of a trace.

Counts come from a file (``.json`` or ``.npy``, shape ``[R, E]``; a ``[T, R, E]``
trace needs ``--step``) or are generated (``--family lognormal --sigma 1 ...``).
The text output has per-rank loads and slots, the group flows, and ``alloc[e, r]`` of
every expert executed on more than one rank (the others run entirely at home);
``--json`` has the summary and every plan tensor (``plan.alloc [E, R]``, ...).
``--save FILE`` also writes the counts it planned (``.npy`` or ``.json``), a file that
``moonplan plan FILE`` reads back.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from moonplan.cli.args import (
    add_ranks,
    add_seed,
    add_slots,
    add_subcommand,
    fail,
    float_range,
    int_range,
)
from moonplan.cli.choices import COUNT_FAMILIES, PLAN_BACKENDS, listed
from moonplan.tables import render

if TYPE_CHECKING:
    import torch

    import moonplan

HELP = "plan one step's router counts and print per-rank loads before/after"
DESCRIPTION = (
    "Plan exact balance for router counts [R, E] read from a file or generated. "
    "Write a counts file to plan later with --save counts.npy (or .json)."
)


def register(subparsers: Any) -> None:
    """Add the ``plan`` subcommand (handler in ``args.func``)."""
    p = add_subcommand(subparsers, "plan", handler, HELP, DESCRIPTION)
    _counts_args(p)
    _plan_args(p)


def _counts_args(p: argparse.ArgumentParser) -> None:
    """Where the counts come from: a file, or the generator's settings."""
    p.add_argument(
        "counts",
        nargs="?",
        help="counts file (.json or .npy), [R,E] or [T,R,E], as --save writes it "
        "(default: generate counts with --family)",
    )
    p.add_argument(
        "--step",
        type=int_range(0),
        default=None,
        help="step of a [T,R,E] trace file (required there; default: none)",
    )
    p.add_argument(
        "--family",
        default="lognormal",
        choices=COUNT_FAMILIES,
        help=f"popularity family of generated counts: {listed(COUNT_FAMILIES)} (default lognormal)",
    )
    p.add_argument("--sigma", type=float_range(0), default=1.0, help="lognormal sigma (default 1)")
    add_ranks(p, default=8, help="EP size R of generated counts (default 8)")
    p.add_argument(
        "--experts", type=int_range(1), default=64, help="E of generated counts (default 64)"
    )
    p.add_argument(
        "--tokens", type=int_range(0), default=4096, help="tokens per rank (default 4096)"
    )
    p.add_argument("--topk", type=int_range(1), default=8, help="top-k (default 8)")
    add_seed(p, help="seed of generated counts (default 0)")


def _plan_args(p: argparse.ArgumentParser) -> None:
    """How to plan them and what to print or write."""
    add_slots(p, help="prefetch slots B per rank (default ceil(E/R))")
    p.add_argument(
        "--align", type=int_range(1), default=1, help="row padding, in records (default 1)"
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=PLAN_BACKENDS,
        help=f"planner backend: {listed(PLAN_BACKENDS)} (default auto: cuda for counts on "
        "a GPU where it is available, else torch)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the summary and every plan tensor as JSON (default: tables)",
    )
    p.add_argument(
        "--save",
        metavar="FILE",
        default=None,
        help="also write the planned counts [R,E] to FILE (.npy or .json; default: none)",
    )


def load_or_generate(args: argparse.Namespace) -> torch.Tensor:
    """The ``[R, E]`` counts the arguments describe."""
    from moonplan.traces import generate_counts, load_counts

    if args.counts:
        counts = load_counts(args.counts)
        if counts.dim() == 3:
            T = counts.shape[0]
            if args.step is None:
                raise ValueError(
                    f"{args.counts} is a [T, R, E] trace of {T} steps: pass --step (0..{T - 1})"
                )
            if not 0 <= args.step < T:
                raise ValueError(f"--step {args.step} outside the trace's {T} steps")
            counts = counts[args.step]
        elif args.step is not None:
            raise ValueError(f"--step applies to [T, R, E] traces; {args.counts} is [R, E]")
        return counts
    if args.step is not None:
        raise ValueError("--step selects a step of a counts file; generated counts have one")
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
    import moonplan
    from moonplan.baselines import copies_lower_bound, moonep_greedy_alloc, replica_count

    if args.backend == "cuda":
        from moonplan.plan.cuda_backend import available

        ok, why = available()
        if not ok:
            return fail("moonplan plan", f"--backend cuda is unavailable here: {why}")
    try:
        counts_RE = load_or_generate(args)
        plan = moonplan.plan(counts_RE, slots=args.slots, align=args.align, backend=args.backend)
        moonplan.check_plan(plan, counts_RE)
        if args.save:
            from moonplan.traces import save_counts

            save_counts(args.save, counts_RE)
    except (ValueError, OSError) as exc:
        return fail("moonplan plan", str(exc))
    summary = plan.summary()
    summary["moonep_greedy_copies"] = replica_count(moonep_greedy_alloc(counts_RE))
    summary["copies_lower_bound"] = copies_lower_bound(counts_RE)
    if args.json:
        print(json.dumps({**summary, "plan": plan_fields(plan)}))
    else:
        print(format_plan_table(summary, plan))
    if args.save:  # JSON output stays one document: the note goes to stderr
        print(f"wrote {args.save}", file=sys.stderr if args.json else sys.stdout)
    return 0


def plan_fields(plan: moonplan.Plan) -> dict[str, Any]:
    """Every tensor of ``plan`` as nested lists (see :class:`moonplan.Plan`), plus
    ``num_slots``, ``align`` and ``backend``."""
    from moonplan.plan.plan_type import PLAN_TENSORS

    out: dict[str, Any] = {name: getattr(plan, name).tolist() for name in PLAN_TENSORS}
    return out | {"num_slots": plan.num_slots, "align": plan.align, "backend": plan.backend}


def format_plan_table(s: dict[str, Any], plan: moonplan.Plan | None = None) -> str:
    """Per-rank table and totals of a :meth:`Plan.summary` (plus baseline copies); with
    ``plan``, also each rank's slots, the group flows and the replicated experts' ``alloc``."""
    head = f"R={s['ranks']} E={s['experts']} slots B={s['slots']} records N={s['records']}"
    header = ["rank", "static load", "planned load", "remote experts"]
    cols = [s["static_load"], s["planned_load"], s["remote_experts"]]
    if plan is not None:
        header.append("slots (expert, * = new)")
        cols.append([_slots(plan, r) for r in range(plan.num_ranks)])
    rows = [[str(r), *(str(c[r]) for c in cols)] for r in range(s["ranks"])]
    lines = [head, render(header, rows)]
    lines += [
        f"max/mean load: static EP {s['static_max_over_mean']:.3f} -> "
        f"moonplan {s['planned_max_over_mean']:.3f}",
        f"copies: moonplan {s['copies']} (direct {s['direct']}), "
        f"MoonEP greedy {s['moonep_greedy_copies']}, lower bound {s['copies_lower_bound']}",
        f"remote experts per rank: max {s['max_remote_experts']} "
        f"(bound ceil(E/R) = {s['remote_bound']})",
    ]
    if plan is not None:
        lines += ["", *_flows(plan), "", *_alloc(plan)]
    return "\n".join(lines)


def _slots(plan: moonplan.Plan, r: int) -> str:
    cells = [
        f"{e}{'*' if new else ''}"
        for e, new in zip(plan.slot_expert[r].tolist(), plan.slot_new[r].tolist(), strict=True)
        if e >= 0
    ]
    return " ".join(cells) or "-"


def _flows(plan: moonplan.Plan) -> list[str]:
    rows = [[str(d), str(r), str(n)] for d, r, n in plan.flow.tolist() if d >= 0]
    if not rows:
        return ["flows: none (every rank already at its target)"]
    title = "group flows, in the planner's order (records a donor rank's experts send)"
    return [title, render(["donor", "receiver", "records"], rows)]


def _alloc(plan: moonplan.Plan) -> list[str]:
    alloc_ER = plan.alloc.cpu()
    split = ((alloc_ER > 0).sum(1) > 1).nonzero().flatten().tolist()
    if not split:
        return ["alloc[e, r]: every expert runs entirely on its home rank"]
    R = plan.num_ranks
    home = plan.home.tolist()
    rows = [
        [str(e), str(home[e]), str(int(alloc_ER[e].sum()))]
        + [
            f"{v}{'*' if r == home[e] and v else ''}" if v else "."
            for r, v in enumerate(alloc_ER[e].tolist())
        ]
        for e in split
    ]
    title = (
        f"alloc[e, r] of the {len(split)} experts executed on several ranks (* = home; "
        f"the other {plan.num_experts - len(split)} run entirely at home)"
    )
    return [title, render(["expert", "home", "records", *[f"r{r}" for r in range(R)]], rows)]
