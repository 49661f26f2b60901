"""GPU sections of ``policy="auto"`` for ``bench/gpu_check.py``: the fused choice kernel.

Legend: R ranks, E experts, S tokens per rank, K top-k, B slots per rank (min(2, ceil(E/R))),
C = LEVELS + 4 candidates; counts lognormal (sigma 1), a multinomial of ``S*K`` records
per rank (``_gpu_planner.lognormal_counts``), ``previous`` the exact plan of other counts.

Sections (``moonplan.plan.choice_cuda``, ``docs/gpu_planner.md``, "The choice kernel"):
    choice_random   random and adversarial cases, chains of two steps, four cost regimes:
                    ``choose(path="cuda")`` against ``choose(path="reference")``, every plan
                    field, ``scores`` bit for bit, ``index``, ``exited`` and ``credit``
    auto            ``moonplan.plan(policy="auto", check_input=False)`` at AUTO_SHAPES on
                    both paths of the one call: ``full`` (a cost with ``exit_s = 1e9`` s:
                    every candidate built and scored) and ``exit`` (``plan_s = 1e9`` s: the
                    early exit is taken). Per row: the host time of one eager call (the
                    call returns before the device finishes), the synchronised eager
                    time, the CUDA-graph replay time, and the plans (eager, captured, and
                    replayed on new counts) against the reference.

Targets (issue 22): auto in graph replay <= 25 us at EP 8 and <= 60 us at EP 64; one eager
call <= 80 us of host time at EP 8. ``--cpu-smoke`` runs the ``auto`` rows on the CPU
(the host form of the choice; no graph) on a tiny shape.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from _common import median_us
from _gpu_planner import capture, lognormal_counts, random_case, time_eager, time_replay

import moonplan
from moonplan.plan.choice import choose
from moonplan.plan.plan_type import PLAN_TENSORS, Plan, plan_to
from moonplan.stepcost import StepCost

AUTO_SHAPES = [(8, 256, 4096, 8), (8, 896, 8192, 8), (64, 896, 8192, 8)]
GRAPH_TARGET_US = {8: 25.0, 64: 60.0}  # auto in CUDA-graph replay, by R
HOST_TARGET_US = 80.0  # one eager call's host time at EP 8
FORCED_S = 1e9  # a charge no step beats: forces one path of the call
CHOICE_CASES = 40
BASE = StepCost.from_hardware("h200-node", "deepseek-v3")


def forced(path: str, base: StepCost = BASE) -> StepCost:
    """``base`` with one path of ``auto`` forced: ``full`` or ``exit``."""
    return base.scaled(exit_s=FORCED_S) if path == "full" else base.scaled(plan_s=FORCED_S)


def differences(got: Plan, want: Plan) -> list[str]:
    """The fields (and choice parts) where ``got`` differs from ``want`` (host copies)."""
    bad = [k for k in PLAN_TENSORS if not torch.equal(getattr(got, k).cpu(), getattr(want, k))]
    g, w = got.choice, want.choice
    assert g is not None and w is not None
    if not torch.equal(g.scores.cpu().view(torch.int64), w.scores.view(torch.int64)):
        bad.append("scores")
    bad += [n for n in ("index", "exited") if int(getattr(g, n)) != int(getattr(w, n))]
    if float(g.credit) != float(w.credit):
        bad.append("credit")
    return bad


# ---- the kernel against the reference -----------------------------------------------------------


def choice_random_section() -> dict[str, Any]:
    """``choose(path="cuda")`` against the reference on random cases (module docstring)."""
    rng = random.Random(22)
    regimes = [forced("full"), forced("exit"), forced("full", BASE.scaled(domain=2,
               overlap=False)), BASE.scaled(copy_s_intra=0.0, copy_s_inter=0.0)]  # fmt: skip
    bad: list[dict[str, Any]] = []
    n = 0
    for _ in range(CHOICE_CASES):
        counts_RE, B, align = random_case(rng)
        cost = rng.choice(regimes)
        prev_cpu = prev_gpu = None
        for _ in range(2):  # then with this plan as previous
            want = choose(counts_RE, B, align, prev_cpu, cost, "reference")
            got = choose(counts_RE.cuda(), B, align, prev_gpu, cost, "cuda")
            keys = differences(got, want)
            n += 1
            if keys:
                bad.append({"shape": list(counts_RE.shape), "B": B, "align": align,
                            "cost": repr(cost)[:200], "fields": keys})  # fmt: skip
            prev_cpu, prev_gpu = want, plan_to(want, torch.device("cuda"))
            counts_RE = counts_RE.roll(1, dims=1)
    if bad:
        raise AssertionError(f"{len(bad)} of {n} choices differ; first: {bad[:5]}")
    return {"cases": n}


# ---- auto: host, eager and graph times -----------------------------------------------------------


def _auto_row(shape: tuple[int, int, int, int], path: str, dev: torch.device, reps: int) -> dict:
    R, E, S, K = shape
    B = min(2, -(-E // R))
    cost = forced(path)
    counts_RE = lognormal_counts(R, E, S, K, 7)
    static_RE = counts_RE.to(dev)  # the captured graph reads this buffer
    prev = moonplan.plan(lognormal_counts(R, E, S, K, 6).to(dev), slots=B, align=128)
    opts = {"slots": B, "align": 128, "previous": prev, "policy": "auto", "cost": cost}

    def fn() -> Plan:
        return moonplan.plan(static_RE, check_input=False, **opts)

    row: dict[str, Any] = {"shape": list(shape), "path": path}
    want = choose(counts_RE, B, 128, prev, cost, "reference")
    got = fn()
    row |= {"policy": got.policy, "exited": bool(got.choice.exited), "backend": got.backend}
    row["eager_differs"] = differences(got, want)
    row["host_us"] = round(median_us(fn, reps, dev.type == "cuda", drain_after=False), 1)
    row["eager_us"] = round(time_eager(fn, reps), 1)
    if dev.type == "cuda":
        _graph(row, fn, static_RE, (B, prev, cost), want)
    row["matches_reference"] = not row["eager_differs"] and not row.get("graph_differs")
    return row


def _graph(
    row: dict, fn: Callable[[], Plan], static_RE: torch.Tensor, how: tuple, want: Plan
) -> None:
    """Capture ``fn``, check its plan and a replay on new counts, time the replays."""
    B, prev, cost = how
    try:
        graph, out = capture(fn)
    except Exception as exc:
        row["graph_error"] = f"not capturable: {type(exc).__name__}: {exc}"[:300]
        torch.cuda.synchronize()
        return
    graph.replay()
    torch.cuda.synchronize()
    differs = differences(out, want)
    R, E = static_RE.shape
    new_RE = lognormal_counts(R, E, 1024, 8, 8)
    static_RE.copy_(new_RE)
    graph.replay()
    torch.cuda.synchronize()
    differs += [
        f"replay:{k}" for k in differences(out, choose(new_RE, B, 128, prev, cost, "reference"))
    ]
    row["graph_differs"] = differs
    row["graph_us"] = round(time_replay(graph), 2)


def auto_section(smoke: bool = False) -> dict[str, Any]:
    """``policy="auto"`` per shape and path (module docstring), with its targets."""
    dev = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    shapes = [(4, 16, 64, 2)] if smoke else AUTO_SHAPES
    reps = 3 if smoke else 20
    rows = []
    for shape in shapes:
        for path in ("full", "exit"):
            try:
                rows.append(_auto_row(shape, path, dev, reps))
            except Exception as exc:
                rows.append({"shape": list(shape), "path": path,
                             "error": f"{type(exc).__name__}: {exc}"[:300]})  # fmt: skip
    verdicts = [_verdict(r) for r in rows] if dev.type == "cuda" else []
    same = all(r.get("matches_reference") for r in rows)
    if not same:
        raise AssertionError(f"auto differs from the reference or failed: {rows}")
    return {"device": str(dev), "rows": rows, "meets_targets": all(verdicts) if verdicts else None}


def _verdict(row: dict[str, Any]) -> bool:
    """Whether a GPU row meets its targets (graph replay by R; host time at EP 8)."""
    R = row["shape"][0]
    ok = row.get("graph_us", float("inf")) <= GRAPH_TARGET_US.get(R, float("inf"))
    if R == 8:
        ok = ok and row.get("host_us", float("inf")) <= HOST_TARGET_US
    row["meets_targets"] = ok
    return ok


CHOICE_SECTIONS = {"choice_random": choice_random_section}
"""The choice kernel against the reference (``gpu_check`` runs it where
``choice_cuda.available()``)."""
