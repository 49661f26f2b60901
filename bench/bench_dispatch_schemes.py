"""Dispatch schemes in the simulator: rows per record, bytes per link and step time of
every policy when dispatch sends a row per record, per (token, rank) or per (token, host).

DeepSeek-V3 (H = 7168, top-8 of 256, group-limited: 8 groups, top-4 groups) on
``h200-multinode`` (NVLink domains of 8): EP 8 is one host, EP 64 eight hosts. Every
point samples each token's top-8 set (``moonplan.simulate.token_routing``) from the
drifting workload (sigma 1, 4096 tokens per rank), runs every policy on the tokens'
counts once, and charges each measured step under the three schemes side by side
(same steps, same plans: only the dispatch rows differ).

Columns: ``rows/rec`` rows leaving the sources per record (``"host"``: rows inside the
source's host plus one per destination host; forwarded copies are counted in the
NVLink bytes); ``net GB`` and ``nvl GB`` dispatch bytes over the network and NVLink,
summed over ranks (bf16; combine moves the same in reverse); ``dispatch us``,
``step us`` the simulated phases (mean of the measured steps) and ``x record`` the step
time over the same policy's per-record one. ``plain rows/rec`` (moonplan policies):
the same plans routed without affinity.

First it prints rows per record of uniform top-8 of 64 experts on 8 ranks (static
placement; plain and group-limited routing) and the token sampler's speed at EP 64.

    python bench/bench_dispatch_schemes.py            # JSON to bench/results/dispatch_schemes.json
    python bench/bench_dispatch_schemes.py --quick    # EP 8 only, fewer tokens
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
from _common import bench_parser, result_path, write_json

from moonplan.baselines import make_policy
from moonplan.simulate.dispatch_rows import AFFINITY_POLICIES, step_dest, step_traffic
from moonplan.simulate.model_time import SimConfig
from moonplan.simulate.models import get_model
from moonplan.simulate.sweep import policy_options
from moonplan.simulate.token_routing import drifting_tokens, token_trace
from moonplan.simulate.workload import drifting_popularity
from moonplan.stepcost.hardware import get_hardware
from moonplan.stepcost.traffic import SCHEMES, rows_per_record
from moonplan.tables import render

POLICIES = (
    "static-linear",
    "capacity-1.0",
    "eplb",
    "moonep-greedy",
    "moonplan",
    "moonplan-resident",
    "moonplan-auto",
)


def measure_point(R: int, tokens: int, sigma: float, warmup: int, steps: int) -> dict[str, Any]:
    """Rows of one EP size: every policy under every scheme (module docstring)."""
    model, hw, cfg = get_model("deepseek-v3"), get_hardware("h200-multinode"), SimConfig()
    E, T = model.num_experts, warmup + steps
    t0 = time.perf_counter()
    pops = drifting_popularity(E, sigma=sigma, steps=T, seed=0)
    counts, ids = token_trace(model, R, tokens, pops, seed=1)
    sample_s = time.perf_counter() - t0
    opts = policy_options(hw, R, 4)
    rows = []
    for name in POLICIES:
        policy = make_policy(name, R, E, cost=cfg.step_cost(model, hw, name), **opts)
        measured = [(policy.step(c), i.long()) for c, i in zip(counts, ids, strict=True)][warmup:]
        rows += policy_rows(name, measured, model, hw, cfg)
    return {"ranks": R, "tokens": tokens, "sigma": sigma, "sample_s": sample_s, "rows": rows}


def policy_rows(name: str, measured: list[Any], model: Any, hw: Any, cfg: SimConfig) -> list[Any]:
    """One row per scheme for one policy's measured steps."""
    R = measured[0][0].rows_ER.shape[1]
    cost = cfg.step_cost(model, hw, name)
    G, row_bytes = cost.domain_size(R), model.hidden_size * cfg.dispatch_bytes
    out: dict[str, dict[str, float]] = {s: {} for s in SCHEMES}
    for step, ids in measured:
        dest = step_dest(step, ids, name in AFFINITY_POLICIES)
        plain = step_dest(step, ids, affinity=False) if name in AFFINITY_POLICIES else None
        fetch = step.fetch_ER if step.fetch_ER is not None else torch.zeros_like(step.rows_ER) > 0
        src = step.src_E if step.src_E is not None else torch.zeros(step.rows_ER.shape[0])
        for scheme in SCHEMES:
            traffic = step_traffic(step, ids, scheme, G, dest)
            t = cost.scaled(dispatch=scheme).step_time(
                step.rows_ER, step.sent_RE, fetch, src, planned=step.planned, traffic=traffic
            )
            got = {
                "rows_per_record": rows_per_record(dest, scheme, G),
                "net_gb": float(traffic.send_inter_R.sum()) * row_bytes / 1e9,
                "nvlink_gb": float(traffic.send_intra_R.sum()) * row_bytes / 1e9,
                "dispatch_us": t.dispatch_s * 1e6,
                "combine_us": t.combine_s * 1e6,
                "step_us": t.total_s * 1e6,
            }
            if plain is not None:
                got["plain_rows_per_record"] = rows_per_record(plain, scheme, G)
            for k, v in got.items():
                out[scheme][k] = out[scheme].get(k, 0.0) + v / len(measured)
    return [{"policy": name, "scheme": s, **v} for s, v in out.items()]


def uniform_rows(tokens: int) -> dict[str, float]:
    """Rows per record of uniform top-8 of 64 experts on 8 ranks (static placement, 8
    experts a rank), plain and group-limited (8 groups, top-4), as ``"rank"`` sends them;
    and the token sampler's speed (records per second) at EP 64 of DeepSeek-V3."""
    uniform = [torch.full((64,), 1 / 64, dtype=torch.float64)]
    out = {}
    for label, groups in (("plain", None), ("group-limited", (8, 4))):
        ids = next(drifting_tokens(uniform, 8, tokens, 8, groups=groups)).long()
        out[label] = rows_per_record(ids // 8, "rank", 8)
    model = get_model("deepseek-v3")
    for label, m in (("plain", replace(model, name="plain")), ("group-limited", model)):
        t0 = time.perf_counter()
        token_trace(m, 64, tokens, drifting_popularity(256, sigma=1.0, steps=2))
        out[f"sample_{label}_records_per_s"] = 2 * 64 * tokens * 8 / (time.perf_counter() - t0)
    return out


def table(point: dict[str, Any]) -> str:
    """The point's rows as a Markdown table, step time also as a ratio to ``"record"``."""
    rec = {r["policy"]: r["step_us"] for r in point["rows"] if r["scheme"] == "record"}
    lines = [
        [
            r["policy"],
            r["scheme"],
            f"{r['rows_per_record']:.3f}",
            f"{r['plain_rows_per_record']:.3f}" if "plain_rows_per_record" in r else "-",
            f"{r['net_gb']:.3f}",
            f"{r['nvlink_gb']:.3f}",
            f"{r['dispatch_us']:,.0f}",
            f"{r['step_us']:,.0f}",
            f"{r['step_us'] / rec[r['policy']]:.3f}",
        ]
        for r in point["rows"]
    ]
    header = ["policy", "scheme", "rows/rec", "plain rows/rec", "net GB", "nvl GB"]
    header += ["dispatch us", "step us", "x record"]
    return render(header, lines, markdown=True)


def summary(points: list[dict[str, Any]], focus: str = "moonplan-resident") -> str:
    """One line per (EP size, scheme): ``focus``'s rows per record (affinity / plain) and
    dispatch + combine GB per link class (summed over ranks), then every policy's step
    time in us (Markdown)."""
    header = ["EP", "scheme", "rows/rec", "net GB", "NVLink GB", *POLICIES]
    lines = []
    for point in points:
        for scheme in SCHEMES:
            got = {r["policy"]: r for r in point["rows"] if r["scheme"] == scheme}
            f = got[focus]
            lines.append(
                [
                    str(point["ranks"]),
                    scheme,
                    f"{f['rows_per_record']:.3f} / {f['plain_rows_per_record']:.3f}",
                    f"{2 * f['net_gb']:.1f}",
                    f"{2 * f['nvlink_gb']:.1f}",
                    *(f"{got[p]['step_us']:,.0f}" for p in POLICIES),
                ]
            )
    return render(header, lines, markdown=True)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="EP 8 only, 512 tokens per rank")
    parser.add_argument("--out", default=result_path("dispatch_schemes.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    ranks, tokens = ((8,), 512) if args.quick else ((8, 64), 4096)
    t0 = time.perf_counter()
    ref = uniform_rows(tokens)
    print("rows/rec, uniform top-8 of 64 on 8 ranks:", f"plain {ref['plain']:.3f},")
    print(f"group-limited {ref['group-limited']:.3f}; token sampling at EP 64 (M records/s):")
    print(f"plain {ref['sample_plain_records_per_s'] / 1e6:.2f}, ", end="")
    print(f"group-limited {ref['sample_group-limited_records_per_s'] / 1e6:.2f}")
    points = []
    for R in ranks:
        point = measure_point(R, tokens, 1.0, warmup=2, steps=2)
        print(f"\nDeepSeek-V3, EP {R} on h200-multinode, {tokens} tokens/rank, sigma 1")
        print(table(point))
        points.append(point)
    seconds = time.perf_counter() - t0
    print("\nSummary (rows/rec and GB of moonplan-resident; step time per policy, us)")
    print(summary(points))
    print(f"\n{seconds:.0f} s")
    write_json(args.out, {"uniform": ref, "points": points, "seconds": seconds})


if __name__ == "__main__":
    main()
