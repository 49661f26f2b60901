"""``moonplan simulate``: estimated MoE step time of every balancing policy, swept over skew
and EP size (see ``moonplan.simulate`` and ``docs/simulator.md``).

``register(subparsers)`` adds the subcommand; ``moonplan/cli/main.py`` wires it in.

    moonplan simulate --model deepseek-v3 --hardware h200-multinode --ep 8,64 --sigma 0,1,2
    moonplan simulate --maxvio 0.5,1,2 --plot sweep.png --json
    moonplan simulate --counts trace.npy --model mixtral-8x7b      # a recorded [T, R, E] trace
    moonplan simulate --counts moonplan/traces/data/decode-l1.npz --model olmoe-1b-7b
    moonplan simulate --persistent 0                               # drift only (the earlier law)
    moonplan simulate --break-even --ep 8 --sigma 1                # tokens/rank where copying pays
    moonplan simulate --serial-prefetch                            # the old serial fetch schedule
    moonplan simulate --dispatch host                              # a row per (token, host)
    moonplan simulate --trends                                     # DeepSpeed-MoE and GShard trends
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from moonplan.cli.args import (
    add_seed,
    add_slots,
    add_steps,
    add_subcommand,
    float_range,
    int_range,
)
from moonplan.cli.choices import (
    DEPLOYED_PERIOD,
    DEPLOYED_WINDOW,
    DISPATCH_SCHEMES,
    HARDWARE,
    MEASURED_STEPS,
    MODEL_PRESETS,
    PERSISTENT_SHARE,
    PLAN_US,
    POLICIES,
    TOKEN_GRID,
    TREND_MODELS,
    WARMUP_STEPS,
    listed,
)
from moonplan.cli.cost import preset_name

if TYPE_CHECKING:
    from moonplan.simulate.model_time import SimConfig
    from moonplan.simulate.sweep import SweepSpec


def _list(kind: Any) -> Any:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list, got {text!r}"
            ) from None
        except argparse.ArgumentTypeError as exc:  # an entry out of range
            raise argparse.ArgumentTypeError(f"in {text!r}: {exc}") from None

    return parse


HELP = "estimate per-step MoE time of each balancing policy (sweeps skew and EP size)"
DESCRIPTION = (
    "Roofline + communication model of one MoE layer step for static EP, "
    "capacity, EPLB (as deployed, and every 4 steps with its moves charged), the MoonEP "
    "greedy and moonplan (see docs/simulator.md)."
)
MODELS = (*MODEL_PRESETS, *TREND_MODELS, "gshard-<E>e")


def register(subparsers: Any) -> None:
    """Add the ``simulate`` subcommand (handler in ``args.func``)."""
    p = add_subcommand(subparsers, "simulate", handler, HELP, DESCRIPTION)
    _workload_args(p)
    _step_args(p)
    _policy_args(p)
    _mode_args(p)


def _workload_args(p: argparse.ArgumentParser) -> None:
    """Model, hardware, EP sizes, skew and tokens of each point."""
    p.add_argument(
        "--model",
        default="deepseek-v3",
        help=f"model preset, case-insensitive: {listed(MODELS)} (default deepseek-v3)",
    )
    p.add_argument(
        "--hardware",
        default="h200-multinode",
        type=preset_name,
        choices=HARDWARE,
        help=f"hardware preset, case-insensitive: {listed(HARDWARE)} (default h200-multinode)",
    )
    p.add_argument(
        "--ep", "--ranks", type=_list(int_range(1)), default=[8, 64],
        help="comma-separated EP sizes (default 8,64)",
    )  # fmt: skip
    p.add_argument(
        "--sigma",
        type=_list(float),
        default=[0, 0.25, 0.5, 1, 2],
        help="comma-separated lognormal sigmas of expert popularity (default 0,0.25,0.5,1,2)",
    )
    p.add_argument(
        "--maxvio",
        type=_list(float),
        default=None,
        help="comma-separated expert MaxVio targets, instead of --sigma (default: none)",
    )
    p.add_argument(
        "--tokens", type=int, default=4096, help="tokens per rank per step (default 4096)"
    )


def _step_args(p: argparse.ArgumentParser) -> None:
    """The steps of each point: how many, their drift, seed and sampler, or a trace."""
    add_steps(
        p,
        default=MEASURED_STEPS,
        help=f"measured steps per point (default {MEASURED_STEPS}; with --counts the last ones)",
        warmup=(
            WARMUP_STEPS,
            f"steps run before measuring (default {WARMUP_STEPS}; --counts: the steps before "
            "the measured ones)",
        ),
    )
    p.add_argument(
        "--rho",
        type=float_range(-1, 1),
        default=0.99,
        help="step-to-step correlation of the drifting popularity (default 0.99)",
    )
    p.add_argument(
        "--persistent",
        type=float_range(0, 1),
        default=PERSISTENT_SHARE,
        help=f"persistent share of the log-popularity's variance (default {PERSISTENT_SHARE}, "
        "measured on real routing; 0: drift only, the earlier model)",
    )
    add_slots(p, help="redundant slots per rank for moonplan and EPLB (default: each one's own)")
    add_seed(p, help="seed of the generated counts (default 0)")
    p.add_argument(
        "--exact",
        action="store_true",
        help="exact top-k sampling (slow at scale; default: the fast sampler)",
    )
    p.add_argument(
        "--counts",
        help="recorded counts (.npy/.json, [T,R,E]) instead of generated (default: none)",
    )
    p.add_argument(
        "--training",
        action="store_true",
        help="with --counts: the steps are training steps: moonplan's slots go stale "
        "at every step as in the runtime, and each step is charged its backward too "
        "(default: forward steps whose slots stay, as in inference)",
    )


def _policy_args(p: argparse.ArgumentParser) -> None:
    """Which policies run and what they are charged."""
    p.add_argument(
        "--policies",
        type=_list(str),
        default=None,
        help=f"comma-separated policies (default: every registered one: {listed(POLICIES)})",
    )
    p.add_argument(
        "--plan-us",
        action="append",
        default=[],
        metavar="POLICY=US",
        help=f"planning time of a policy in us, repeatable (default: {PLAN_US:g} for "
        "moonep-greedy, moonplan's kernel time by shape for moonplan's policies)",
    )
    p.add_argument(
        "--dispatch-bytes",
        type=float,
        default=2.0,
        help="bytes per element of dispatch (default 2; 1: FP8)",
    )
    p.add_argument(
        "--dispatch",
        choices=DISPATCH_SCHEMES,
        default="record",
        help="dispatch rows, for every policy: per record (default), per (token, rank) or "
        "per (token, host) with forwarding inside the host; rank/host sample every token",
    )
    p.add_argument(
        "--serial-prefetch",
        action="store_true",
        help="the old serial schedule, fetch then dispatch (default: overlapped)",
    )
    p.add_argument(
        "--eplb-period",
        type=int_range(1),
        default=None,
        help=f"deployed EPLB's rearrangement period in steps (default {DEPLOYED_PERIOD}; "
        "--counts: half the warm-up)",
    )
    p.add_argument(
        "--eplb-window",
        type=int_range(1),
        default=None,
        help=f"deployed EPLB's window in steps (default {DEPLOYED_WINDOW}; --counts: half the "
        "warm-up)",
    )
    p.add_argument(
        "--eplb-groups",
        type=int_range(1),
        default=1,
        help="expert groups of hierarchical EPLB (default 1)",
    )


def _mode_args(p: argparse.ArgumentParser) -> None:
    """What to compute instead of the sweep, and how to print it."""
    p.add_argument("--break-even", action="store_true", help="break-even tokens per rank instead")
    p.add_argument(
        "--tokens-grid",
        type=_list(int_range(1)),
        default=list(TOKEN_GRID),
        help=f"comma-separated tokens per rank that --break-even tries (default "
        f"{','.join(str(t) for t in TOKEN_GRID)})",
    )
    p.add_argument("--trends", action="store_true", help="DeepSpeed-MoE and GShard trends instead")
    p.add_argument("--detail", action="store_true", help="also print every phase and metric")
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="plot step time vs skew or EP size (or per policy, with --counts) to this file; "
        "refused with --break-even and --trends (default: no plot)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _config(args: argparse.Namespace) -> SimConfig:
    from moonplan.simulate.model_time import SimConfig, default_plan_us

    plan_us = default_plan_us()
    for item in args.plan_us:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--plan-us expects POLICY=US, got {item!r}")
        plan_us[name.strip()] = float(value)
    return SimConfig(
        dispatch_bytes=args.dispatch_bytes,
        plan_us=plan_us,
        overlap_prefetch=not args.serial_prefetch,
        dispatch=args.dispatch,
        training=args.training,
    )


def _spec(args: argparse.Namespace) -> SweepSpec:
    from moonplan.baselines.registry import info, names
    from moonplan.simulate.sweep import SweepSpec

    # default: every policy registered when the command runs
    policies = list(names()) if args.policies is None else args.policies
    if not policies or not args.ep or not (args.sigma or args.maxvio):
        raise ValueError("--policies, --ep and --sigma (or --maxvio) need at least one value")
    for name in policies:
        info(name)  # ValueError naming the registered policies
    if min(args.ep) < 1 or args.steps < 1 or args.warmup < 0 or args.tokens < 1:
        raise ValueError("--ep, --steps, --tokens must be >= 1 and --warmup >= 0")
    return SweepSpec(
        model=args.model, hardware=args.hardware, ranks=tuple(args.ep), sigmas=tuple(args.sigma),
        maxvios=None if args.maxvio is None else tuple(args.maxvio), tokens=args.tokens,
        policies=tuple(policies), steps=args.steps, warmup=args.warmup, rho=args.rho,
        persistent=args.persistent, seed=args.seed, slots=args.slots,
        eplb_window=args.eplb_window or DEPLOYED_WINDOW,
        eplb_period=args.eplb_period or DEPLOYED_PERIOD, eplb_groups=args.eplb_groups,
        exact=args.exact,
    )  # fmt: skip


def handler(args: argparse.Namespace) -> int:
    """Run what ``args`` ask for; print tables or JSON; return the exit code."""
    from moonplan.simulate.models import get_model
    from moonplan.simulate.progress import ProgressBar
    from moonplan.stepcost.hardware import get_hardware

    try:
        get_model(args.model)
        get_hardware(args.hardware)
        cfg, spec = _config(args), _spec(args)
        if args.dispatch != "record" and (args.counts or args.trends):
            mode = "--counts" if args.counts else "--trends"
            raise ValueError(f"--dispatch {args.dispatch} samples tokens; {mode} has none")
        if args.plot and (args.break_even or args.trends):
            mode = "--break-even" if args.break_even else "--trends"
            raise ValueError(f"--plot draws sweeps and recorded traces, not {mode}")
        if args.plot:
            from moonplan.simulate.plots import require_matplotlib

            require_matplotlib()  # refuse before the work, not after it
        progress = None if args.no_progress else ProgressBar(description="simulate")
        try:
            report = _run(args, spec, cfg, progress)
        finally:
            if progress is not None:
                progress.close()
        if args.plot:
            from moonplan.simulate.plots import plot_sweep

            plot_sweep(report["rows"], args.plot, title=args.model)
    except (ValueError, RuntimeError) as err:
        print(f"moonplan simulate: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else _text(report, args.detail))
    if args.plot:  # JSON output stays one document: the note goes to stderr
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _run(
    args: argparse.Namespace, spec: SweepSpec, cfg: SimConfig, progress: Any
) -> dict[str, Any]:
    from moonplan.simulate.models import get_model
    from moonplan.simulate.sweep import break_even, sweep
    from moonplan.simulate.trends import deepspeed_trend, gshard_trend

    if args.trends:
        return {
            "deepspeed": deepspeed_trend(cfg=cfg, progress=progress),
            "gshard": gshard_trend(cfg=cfg, progress=progress),
        }
    if args.break_even:
        model = get_model(spec.model)
        results = [
            break_even(spec.model, spec.hardware, R, sigma, tokens=args.tokens_grid, cfg=cfg,
                       spec=spec, progress=progress)
            for R in spec.ranks
            for sigma, _ in spec.skews(model.num_experts, model.top_k)
        ]  # fmt: skip
        return {"break_even": results}
    if args.counts:
        return {"rows": _recorded(args, spec, cfg)}
    return {"rows": sweep(spec, cfg, progress)}


def _recorded(args: argparse.Namespace, spec: SweepSpec, cfg: SimConfig) -> list[dict[str, Any]]:
    """Rows of a recorded trace: its last ``--steps`` steps measured (a trace no longer than
    that: all but its first ``--warmup``, at least one measured), the deployed EPLB's schedule
    fitted to the steps before them unless ``--eplb-window``/``--eplb-period`` are given."""
    from moonplan.simulate.acceptance import recorded_options
    from moonplan.simulate.models import get_model
    from moonplan.simulate.sweep import policy_options, simulate_trace
    from moonplan.simulate.workload import recorded_counts
    from moonplan.stepcost.hardware import get_hardware

    counts = recorded_counts(args.counts)
    model, hw = get_model(spec.model), get_hardware(spec.hardware)
    T, R, _ = counts.shape
    warmup = T - spec.steps if T > spec.steps else min(spec.warmup, T - 1)
    eplb = recorded_options(T, T - warmup)
    if args.eplb_window or args.eplb_period:
        w = args.eplb_window or DEPLOYED_WINDOW
        eplb = {"eplb_window": w, "eplb_period": args.eplb_period or DEPLOYED_PERIOD,
                "eplb_first": w}  # fmt: skip
    opts = policy_options(hw, R, groups=spec.eplb_groups, slots=spec.slots, eplb=eplb)
    opts["stale_slots"] = args.training
    rows = simulate_trace(counts, model, hw, cfg, spec.policies, warmup=warmup, options=opts)
    return [{**r, "sigma": None, "maxvio_target": None} for r in rows]


def _text(report: dict[str, Any], detail: bool) -> str:
    from moonplan.simulate.report import break_even_table, detail_table, sweep_table, trend_table

    parts = []
    if "rows" in report:
        r0 = report["rows"][0]
        parts.append(
            f"moonplan simulate: {r0['model']} on {r0['hardware']}, "
            f"{r0['tokens_per_rank']:.0f} tokens/rank; step time / force-balanced ideal"
        )
        parts.append(sweep_table(report["rows"]))
        if detail:
            parts += ["", detail_table(report["rows"])]
    if "break_even" in report:
        parts.append("break-even tokens per rank (S*: policy no slower than static EP from S* up)")
        parts.append(break_even_table(report["break_even"]))
    if "deepspeed" in report:
        keys = ["gpus", "experts_per_gpu", "moe_layer_us", "forward_us", "per_gpu_speedup"]
        parts += [
            "DeepSpeed-MoE 1.3B+MoE-128, per-GPU throughput",
            trend_table(report["deepspeed"], keys),
        ]
        keys = ["experts", "dispatch_combine_us", "moe_layer_us", "dense_us", "share"]
        parts += ["", "GShard: dispatch+combine share", trend_table(report["gshard"], keys)]
    return "\n".join(parts)
