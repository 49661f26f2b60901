"""MoonMoE step time per ``balance=`` mode against static EP, side by side in one run.

Two ranks (fork, gloo) build one layer per variant with the same weights:
``auto`` (cost-model choice per step in one planner call, calibrated by the layer
itself), ``static``
(``balance="off"``: every record on its home rank), ``exact`` (always exactly
balanced), each with the default slots (``min(2, ceil(E/R))``), and ``exact-M``
(exact with ``slots = ceil(E/R)``, the old default); ``auto-serial`` and
``exact-serial`` are ``auto`` and ``exact`` with ``overlap=False`` (the prefetch and
the replica-gradient reduce inline), to time the overlapped schedule against the
serial one in the same run. They run in turn
(A B C D A B C D ...) in the same processes on the same tokens: forward, then
forward + backward. Routing: uniform, or lognormal-skewed (log-popularity
``sigma * z`` added to the router's logits, ``z`` drifting step to step as an AR(1)
with correlation ``1 - drift``, the same on every rank). Rank 0's barrier-aligned
wall time per step (median) is reported with the ratio to static; ``prefetch`` is
the weight fetch's own time (measured in the worker thread), ``exposed`` the part on
the critical path (handing the job over and the experts' wait for it; a step that
copies nothing starts no job and counts 0: ``docs/runtime.md``), both summed over the
timed steps and ranks, ``exp %`` their ratio; ``plan`` is the ``plan`` phase (the one
planner call and the fetch list every policy reads), summed the same way; ``calls``
counts auto's planner calls that built every candidate (``full``) and that exited
early (``exit``). ``bound`` is what balance alone can give: ``1 / (static max/mean)``,
the experts phase of a perfectly balanced step over static EP's (mean over the timed
steps of static EP's ``max/mean`` load). Last, the acceptance figures of auto: forward
step against static (uniform, lognormal), the lognormal bound, and the lognormal
forward's exposed fraction; the bars are uniform <= 1.02, lognormal <= bound + 0.05,
exposed <= 25%. ``--modes forward`` times the forward only. ``--transport NAME`` builds
every layer on that registered transport (default ``auto``: the heap where one spans
the ranks); ``--serial`` builds them all with ``overlap=False`` (the prefetch inline, the
whole job exposed); the ``-serial`` variants set the two schedules side by side in
one run, e.g. on the all-to-all transport, where the worker's collectives run on a
second process group. Writes JSON (``bench_layer_<transport>[_serial].json`` unless the
transport is ``auto`` and the schedule overlapped).

``--rows``: token rows against per-record rows instead. ``--ranks``
gloo ranks build one layer per transport and rows (the registered names: ``heap``
and ``a2a`` with their default rows, ``heap-tokens``, ``a2a-records``) with the same
weights and uniform top-8 routing of 32 experts; they run in turn (interleaved), and
rank 0's dispatch + combine time (``StepStats.phases``, median over steps) is
reported per transport with the ratio token rows / per-record of the same transport,
the backward pair (combine-backward + dispatch-backward) likewise, and rows sent per
record and bytes sent (``StepStats``); then, counted from routes (no timing), the
rows per record that cross hosts with record rows, token rows and two-stage token
rows (``a2a-hosts``) at R=8, E=64, K=8. Writes JSON.

    python bench/bench_layer.py               # R=2, H=512, F=1024, E=8, K=2, 2048 tokens/rank
    python bench/bench_layer.py --quick       # small sizes (smoke test)
    python bench/bench_layer.py --rows        # token rows vs per-record, R=4, E=32, K=8
    python bench/bench_layer.py --transport a2a --variants auto,static,exact --modes forward
    python bench/bench_layer.py --transport a2a --serial ...  # the same, overlap=False

``--cuda``: the step against static EP on one GPU, R = 1, 2, 4 processes sharing it,
at DeepSeek-V3-like sizes (``bench/_layer_cuda.py`` says what it reports and how
sharing one GPU biases it; docs/benchmarks.md has its 2026-12-04 run); ``--cuda --cpu-smoke`` runs
that code on CPU ranks at tiny sizes. Writes ``bench_layer_cuda.json``.

    python bench/bench_layer.py --cuda [--cuda-ranks 1,2,4] [--tokens 16,256,1024,4096]
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from typing import Any

import torch
from _common import bench_parser, result_path, write_json

from moonplan.runtime.routers import softmax_topk
from moonplan.runtime.transports.registry import builtin_name
from moonplan.testing.dist import run_ranks

VARIANTS = ("auto", "static", "exact", "exact-M", "auto-serial", "exact-serial")
MODES = ("forward", "forward+backward")


def _layers(cfg: dict, holder: dict) -> dict:
    from moonplan import MoonMoE

    E, H, F = cfg["E"], cfg["H"], cfg["F"]
    M = -(-E // 2)
    g = torch.Generator().manual_seed(0)
    w = (
        torch.randn(E, H, generator=g) * 0.02,
        torch.randn(E, 2 * F, H, generator=g) * H**-0.5,
        torch.randn(E, H, F, generator=g) * F**-0.5,
    )
    options = {
        "auto": {"balance": "auto"},
        "static": {"balance": "off"},
        "exact": {"balance": "exact"},
        "exact-M": {"balance": "exact", "slots": M},
        "auto-serial": {"balance": "auto", "overlap": False},
        "exact-serial": {"balance": "exact", "overlap": False},
    }
    layers = {}
    for name in cfg["variants"]:
        cell: dict[str, Any] = {}

        def router(x: torch.Tensor, cell: dict = cell) -> tuple[torch.Tensor, torch.Tensor]:
            return softmax_topk(cell["layer"].router(x) + holder["bias"], cfg["K"])

        layer = MoonMoE(
            H,
            F,
            E,
            cfg["K"],
            router=router,
            max_tokens=cfg["S"],
            transport=cfg["transport"],
            **({"overlap": cfg["overlap"]} | options[name]),
        )
        layer.load_dense(*w)
        cell["layer"] = layer
        layers[name] = layer
    return layers


def _time(layer: Any, x: torch.Tensor, backward: bool) -> float:
    layer.group.barrier()
    t0 = time.perf_counter()
    if backward:
        layer(x).square().mean().backward()
    else:
        with torch.no_grad():
            layer(x)
    layer.group.barrier()
    return time.perf_counter() - t0


def _biases(cfg: dict, steps: int) -> list[torch.Tensor]:
    """Per step log-popularity ``sigma * z_t``, ``z`` an AR(1) of unit variance."""
    g = torch.Generator().manual_seed(1)
    rho = 1.0 - cfg["drift"]
    z = torch.randn(cfg["E"], generator=g)
    out = []
    for _ in range(steps):
        out.append(cfg["sigma"] * z)
        z = rho * z + math.sqrt(max(0.0, 1 - rho * rho)) * torch.randn(cfg["E"], generator=g)
    return out


def _rank(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    holder = {"bias": torch.zeros(cfg["E"])}
    layers = _layers(cfg, holder)
    x = torch.randn(cfg["S"], cfg["H"], generator=torch.Generator().manual_seed(10 + rank))
    warm = cfg["warmup"]
    biases = _biases(cfg, warm + cfg["reps"])
    out: dict[str, Any] = {}
    for mode in cfg["modes"]:
        times: dict[str, list[float]] = {n: [] for n in layers}
        fetch = {n: [0.0, 0.0, 0] for n in layers}  # prefetch s, exposed s, direct reads
        plan_s = {n: 0.0 for n in layers}  # the plan phase
        calls: dict[str, Counter] = {n: Counter() for n in layers}  # auto: full, exit
        policies: dict[str, Counter] = {n: Counter() for n in layers}
        static_mm: list[float] = []
        for i, bias in enumerate(biases):
            holder["bias"] = bias
            for name, layer in layers.items():
                dt = _time(layer, x, mode != "forward")
                if i < warm:
                    continue
                s = layer.last_stats
                times[name].append(dt)
                fetch[name][0] += s.phases.get("prefetch", 0.0)
                fetch[name][1] += s.phases.get("prefetch_exposed", 0.0)
                fetch[name][2] += s.direct_reads
                plan_s[name] += s.phases.get("plan", 0.0)
                calls[name][s.choice] += 1
                policies[name][s.policy] += 1
                if name == "static":
                    static_mm.append(s.static_max_over_mean)
        out[mode] = {
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "fetch": fetch,
            "plan": plan_s,
            "calls": {k: dict(v) for k, v in calls.items()},
            "policies": {k: dict(v) for k, v in policies.items()},
            "static_max_over_mean": statistics.mean(static_mm),
        }
    auto = layers.get("auto")
    out["cost"] = auto.cost.as_tensor().tolist() if auto is not None and auto.cost else None
    return out


def _merge(got: list[dict], mode: str) -> dict:
    """Rank 0's times; prefetch and plan figures summed over ranks."""
    res = dict(got[0][mode])
    res["fetch"] = {
        n: [sum(g[mode]["fetch"][n][i] for g in got) for i in range(3)]
        for n in got[0][mode]["fetch"]
    }
    res["plan"] = {n: sum(g[mode]["plan"][n] for g in got) for n in got[0][mode]["plan"]}
    return res


ROWS_TRANSPORTS = tuple(
    builtin_name(base, rows) for base in ("heap", "a2a") for rows in ("tokens", "records")
)


def _rows_rank(rank: int, world: int, cfg: dict) -> dict:
    """Per transport: rank 0's forward and backward pair times (s), rows and bytes."""
    from moonplan import MoonMoE

    torch.set_num_threads(1)
    E, H, F, K, S = cfg["E"], cfg["H"], cfg["F"], cfg["K"], cfg["S"]
    g = torch.Generator().manual_seed(0)
    w = (
        torch.randn(E, H, generator=g) * 0.02,
        torch.randn(E, 2 * F, H, generator=g) * H**-0.5,
        torch.randn(E, H, F, generator=g) * F**-0.5,
    )
    layers = {}
    for name in ROWS_TRANSPORTS:
        layers[name] = MoonMoE(H, F, E, K, max_tokens=S, transport=name)
        layers[name].load_dense(*w)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(10 + rank))
    got: dict[str, dict[str, list[float]]] = {n: {"fwd": [], "bwd": []} for n in layers}
    traffic: dict[str, list[int]] = {}
    for i in range(cfg["warmup"] + cfg["reps"]):
        for name, layer in layers.items():
            _time(layer, x, True)
            s = layer.last_stats
            if i < cfg["warmup"]:
                continue
            p = s.phases
            got[name]["fwd"].append(p["dispatch"] + p["combine"])
            got[name]["bwd"].append(p["combine_backward"] + p["dispatch_backward"])
            traffic[name] = [s.records, s.rows_sent, s.bytes_sent]
    return {
        n: {k: statistics.median(v) for k, v in t.items()} | {"traffic": traffic[n]}
        for n, t in got.items()
    }


def rows_main(args: Any) -> None:
    """``--rows``: token rows vs per-record rows on both transports (module docstring)."""
    cfg = {"E": 32, "K": 8, "H": 1024, "F": 64, "S": 512, "reps": args.reps, "warmup": 3}
    if args.quick:
        cfg.update(H=64, S=64, reps=3, warmup=1)
    got = run_ranks(_rows_rank, args.ranks, cfg, timeout=1800)
    me = got[0]  # "this rank": rank 0's own times
    print(
        f"R={args.ranks} E={cfg['E']} K={cfg['K']} H={cfg['H']} S={cfg['S']}/rank, "
        f"fp32, uniform routing; rank 0, median of {cfg['reps']} steps"
    )
    print(
        f"{'transport':>13} {'rows':>8} {'d+c ms':>8} {'ratio':>6} {'bwd ms':>8} {'ratio':>6} "
        f"{'rows/rec':>8} {'MB sent':>8}"
    )
    rows = []
    for name in ROWS_TRANSPORTS:
        ref_name = builtin_name(name.split("-")[0], "records")
        ref = me[ref_name]
        r = me[name]
        records, sent_rows, sent_bytes = r["traffic"]
        row = {
            "transport": name,
            "rows": "records" if name == ref_name else "tokens",
            "dispatch_combine_s": r["fwd"],
            "ratio_vs_records": r["fwd"] / ref["fwd"],
            "backward_pair_s": r["bwd"],
            "backward_ratio_vs_records": r["bwd"] / ref["bwd"],
            "rows_per_record": sent_rows / records,
            "bytes_sent": sent_bytes,
            "ranks": args.ranks,
            **cfg,
        }
        rows.append(row)
        print(
            f"{name:>13} {row['rows']:>8} {1e3 * r['fwd']:>8.2f} {row['ratio_vs_records']:>6.3f} "
            f"{1e3 * r['bwd']:>8.2f} {row['backward_ratio_vs_records']:>6.3f} "
            f"{row['rows_per_record']:>8.3f} {sent_bytes / 1e6:>8.2f}"
        )
    hosts = host_rows()
    write_json(
        args.out.replace(".json", "_rows.json"),
        {"torch": torch.__version__, "rows": rows, "cross_host": hosts},
    )


def host_rows(R: int = 8, E: int = 64, K: int = 8, S: int = 1024) -> list[dict]:
    """Rows that cross hosts per record (counted from routes, no timing): one row per
    record, per (token, rank) and, two-stage (``a2a-hosts``), per (token, host)."""
    import moonplan

    g = torch.Generator().manual_seed(0)
    ids = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)]) for _ in range(R)]
    plan = moonplan.plan(torch.stack([torch.bincount(i.view(-1), minlength=E) for i in ids]))
    routes = [moonplan.route(plan, r, ids[r], affinity=True) for r in range(R)]  # token rows
    print(f"cross-host rows per record, R={R} E={E} K={K} S={S}/rank, uniform:")
    print(f"{'ranks/host':>10} {'records':>8} {'tokens':>8} {'2-stage':>8}")
    out = []
    for G in (4, 2):
        n = [0, 0, 0]
        for r, rt in enumerate(routes):
            n[0] += int((rt.dest_rank // G != r // G).sum())
            n[1] += int((rt.unique_dest // G != r // G).sum())
            hosts_V = torch.unique((rt.unique_dest // G) * S + rt.unique_token) // S
            n[2] += int((hosts_V != r // G).sum())
        per = [c / (R * S * K) for c in n]
        out.append({"ranks_per_host": G, "records": per[0], "tokens": per[1], "two_stage": per[2]})
        print(f"{G:>10} {per[0]:>8.3f} {per[1]:>8.3f} {per[2]:>8.3f}")
    return out


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", action="store_true", help="token rows vs per-record rows")
    ap.add_argument("--ranks", type=int, default=4, help="ranks of --rows")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=6, help="untimed steps (auto calibrates)")
    ap.add_argument("--drift", type=float, default=0.1, help="1 - step-to-step correlation")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="any of " + ",".join(VARIANTS))
    ap.add_argument("--modes", default=",".join(MODES), help="any of " + ",".join(MODES))
    ap.add_argument("--transport", default="auto", help="a registered transport name, or auto")
    ap.add_argument("--serial", action="store_true", help="overlap=False on every layer")
    ap.add_argument("--out", default=None, help="JSON path (default: by transport, schedule)")
    add_cuda_arguments(ap)
    args = ap.parse_args()
    if args.cuda:
        cuda_main(args)
        return
    if args.out is None:
        plain = args.transport == "auto" and not args.serial
        tail = "" if plain else f"_{args.transport}" + ("_serial" if args.serial else "")
        args.out = result_path(f"bench_layer{tail}.json")
    if args.rows:
        rows_main(args)
        return
    base = {"E": 8, "K": 2, "H": 512, "F": 1024, "S": 2048}
    base |= {"reps": args.reps, "warmup": args.warmup, "drift": args.drift}
    base |= {"transport": args.transport, "overlap": not args.serial}
    variants = [v for v in args.variants.split(",") if v]
    if "static" not in variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: a subset of {VARIANTS} that includes static")
    base["variants"] = variants
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: a non-empty subset of {MODES}")
    base["modes"] = modes
    if args.quick:
        base.update(H=64, F=128, S=256, reps=3)
    rows = []
    schedule = "serial (overlap=False)" if args.serial else "overlapped"
    print(f"transport {args.transport}, {schedule} schedule")
    head = f"{'routing':>10} {'mode':>17} {'variant':>8} {'ms':>8} {'/static':>7}"
    head += f" {'prefetch ms':>11} {'exposed ms':>10} {'exp %':>6} {'direct':>6}"
    head += f" {'plan ms':>8} {'bound':>6} {'calls':>14}  policies"
    print(head)
    for routing, sigma in (("uniform", 0.0), ("lognormal", 1.0)):
        cfg = {**base, "sigma": sigma}
        got = run_ranks(_rank, 2, cfg, timeout=1800)
        for mode in modes:
            res = _merge(got, mode)
            st = res["median_s"]["static"]
            for name in variants:
                t = res["median_s"][name]
                pf, ex, direct = res["fetch"][name]
                frac = ex / pf if pf > 0 else 0.0
                plan_s = res["plan"][name]
                bound = 1.0 / res["static_max_over_mean"]
                calls = res["calls"][name]
                rows.append(
                    {
                        "routing": routing,
                        "sigma": sigma,
                        "mode": mode,
                        "variant": name,
                        "step_s": t,
                        "ratio_vs_static": t / st,
                        "prefetch_s": pf,
                        "prefetch_exposed_s": ex,
                        "exposed_fraction": frac,
                        "direct_reads": direct,
                        "plan_s": plan_s,
                        "balance_bound": bound,
                        "planner_calls": calls,
                        "policies": res["policies"][name],
                        "static_max_over_mean": res["static_max_over_mean"],
                        **cfg,
                    }
                )
                pol = " ".join(f"{k}:{v}" for k, v in sorted(res["policies"][name].items()))
                print(
                    f"{routing:>10} {mode:>17} {name:>8} {1e3 * t:>8.1f} {t / st:>7.3f} "
                    f"{1e3 * pf:>11.2f} {1e3 * ex:>10.2f} {100 * frac:>6.1f} {direct:>6} "
                    f"{1e3 * plan_s:>8.2f} {bound:>6.3f} "
                    f"{calls.get('full', 0):>5} / {calls.get('exit', 0):>4} exit  {pol}"
                )
        print(f"{routing}: auto's calibrated StepCost rates {got[0]['cost']}")
    accept = acceptance(rows)
    if accept:
        print("auto, forward: " + ", ".join(f"{k} {v:.3f}" for k, v in accept.items()))
    write_json(args.out, {"torch": torch.__version__, "rows": rows, "acceptance": accept})


# ---- --cuda: the step on one GPU (bench/_layer_cuda.py) ----------------------------------------
def add_cuda_arguments(ap: Any) -> None:
    """The options of ``--cuda`` (the CPU bench ignores them)."""
    ap.add_argument("--cuda", action="store_true", help="the step on one GPU (R processes)")
    ap.add_argument("--cpu-smoke", action="store_true", help="--cuda's code on CPU, tiny")
    ap.add_argument("--cuda-ranks", default="1,2,4", help="--cuda: processes sharing the GPU")
    ap.add_argument("--tokens", default=None, help="--cuda: tokens per rank, comma-separated")
    ap.add_argument("--heap", default="ipc", help="--cuda: MOONPLAN_HEAP of the layers")


def cuda_main(args: Any) -> None:
    """``--cuda``: run, print the table and the bars, write JSON."""
    import _layer_cuda

    cfg = _layer_cuda.config(args)
    print(f"--cuda on {cfg['device']}: {cfg}")
    rows = _layer_cuda.run(cfg)
    print("\n".join(_layer_cuda.table(rows)))
    accept = _layer_cuda.acceptance(rows)
    print(f"auto vs static, R={accept.get('R')}: {accept}")
    out = args.out or result_path("bench_layer_cuda.json")
    write_json(out, {"torch": torch.__version__, "config": cfg, "rows": rows, "acceptance": accept})
    missing = sorted(set(cfg["ranks"]) - {r["R"] for r in rows})
    if missing:
        raise SystemExit(f"--cuda: R={missing} failed (printed above); their rows are missing")


def acceptance(rows: list[dict]) -> dict[str, float]:
    """auto's forward figures of the step-time targets (where auto ran): step / static,
    uniform and lognormal, the lognormal bound of balance alone, and the lognormal exposed
    fraction of the prefetch (bars: uniform <= 1.02, lognormal <= bound + 0.05, exposed
    <= 0.25)."""
    fwd = {r["routing"]: r for r in rows if r["variant"] == "auto" and r["mode"] == "forward"}
    out = {f"{k} /static": fwd[k]["ratio_vs_static"] for k in ("uniform", "lognormal") if k in fwd}
    if "lognormal" in fwd:
        out["lognormal bound"] = fwd["lognormal"]["balance_bound"]
        out["lognormal exposed"] = fwd["lognormal"]["exposed_fraction"]
    return out


if __name__ == "__main__":
    main()
