"""GPU sections of the planner for ``bench/gpu_check.py``: the fused kernel and the ``plan`` API.

Legend: R ranks, E experts, S tokens per rank, K top-k, B slots per rank (default M = ceil(E/R)).

Kernel sections (``moonplan.plan.cuda_backend``, as in the first GPU session):
    random     ~200 random cases (with and without ``previous``) vs ``reference_plan``
    graph      capture ``plan_cuda`` in a CUDA graph, replay on new counts, compare
    timing     graph replay time of the cuda and torch backends at the shapes of SHAPES,
               with lognormal (sigma 1) expert popularity; target <= 25 us at (8, 896, 8192, 8)

:func:`api_section` (separate, so that the planner rewrite of issue 22 can adapt it):
the public ``moonplan.plan(...)`` per ``policy`` at API_SHAPES, eager and, where the
call can be captured, in CUDA-graph replay (a call that reads the device on the host
cannot be captured: the row says so).
"""

from __future__ import annotations

import random
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from moonplan.plan import cuda_backend
from moonplan.plan.plan_fields import PlanFields
from moonplan.plan.reference import reference_fields

SHAPES = [(8, 896, 8192, 8), (8, 256, 4096, 8), (64, 896, 8192, 8), (256, 896, 2048, 16)]
TARGET_US = 25.0
RANDOM_CASES = 200
REPLAYS = 200

Fields = PlanFields


# ---- counts ----------------------------------------------------------------------------------


def lognormal_counts(R: int, E: int, S: int, K: int, seed: int) -> torch.Tensor:
    """int64 ``[R, E]``: per rank a multinomial of ``S*K`` records over a lognormal popularity."""
    if S * K == 0:
        return torch.zeros(R, E, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    pop_E = torch.exp(torch.randn(E, generator=g))  # sigma 1
    idx = torch.multinomial(pop_E.expand(R, E), S * K, replacement=True, generator=g)
    counts_RE = torch.zeros(R, E, dtype=torch.int64)
    return counts_RE.scatter_add_(1, idx, torch.ones_like(idx))


def random_case(rng: random.Random) -> tuple[torch.Tensor, int, int]:
    """Small skewed or adversarial counts with a random ``B`` and ``align``."""
    R = rng.choice([1, 2, 3, 4, 5, 8, 13, 16, 40, 64])
    E = rng.choice([1, 2, 3, 7, 8, 16, 17, 64, 100, 256])
    M = -(-E // R)
    B = rng.choice([0, 1, max(M - 1, 0), M, M + 1])
    align = rng.choice([1, 8, 128])
    kind = rng.choice(["lognormal", "lognormal", "zero", "hot", "ties"])
    counts_RE = torch.zeros(R, E, dtype=torch.int64)
    if kind == "hot":
        counts_RE[:, rng.randrange(E)] = torch.randint(0, 50, (R,))
    elif kind == "ties":
        counts_RE[:] = rng.choice([1, 2, 3])
    elif kind == "lognormal":
        S = rng.choice([0, 1, 7, 64])
        counts_RE = lognormal_counts(R, E, S, rng.choice([1, 2, 8]), rng.randrange(1 << 30))
        for s in range(R):  # some empty source ranks
            if rng.random() < 0.2:
                counts_RE[s] = 0
    return counts_RE, B, align


Prev = tuple[torch.Tensor, torch.Tensor] | None  # (slot_expert [R, B], flow [R-1, 3])


def plan_gpu(counts_RE: torch.Tensor, B: int, align: int, prev: Prev) -> Fields:
    """``plan_cuda`` on CUDA copies of the inputs."""
    slots = flows = None
    if prev is not None:
        slots, flows = prev[0].cuda(), prev[1].cuda()
    return cuda_backend.plan_cuda(counts_RE.cuda(), B, align, slots, flows)


def mismatches(got: Fields, want: Fields) -> list[str]:
    return [k for k, v in want._asdict().items() if not torch.equal(getattr(got, k).cpu(), v)]


# ---- sections --------------------------------------------------------------------------------


def random_section() -> dict[str, Any]:
    rng = random.Random(2024)
    bad: list[dict[str, Any]] = []
    n = 0
    for _ in range(RANDOM_CASES):
        counts_RE, B, align = random_case(rng)
        prev: Prev = None
        for _ in range(2):  # without previous, then with this plan as previous
            want = reference_fields(counts_RE, B, align, prev)
            got = plan_gpu(counts_RE, B, align, prev)
            keys = mismatches(got, want)
            n += 1
            if keys and len(bad) < 5:
                bad.append(
                    {
                        "shape": list(counts_RE.shape),
                        "B": B,
                        "align": align,
                        "prev": prev is not None,
                        "fields": keys,
                        "counts": counts_RE.tolist() if counts_RE.numel() <= 64 else None,
                    }
                )
            elif keys:
                bad.append({"fields": keys})
            prev = (want.slot_expert, want.flow)
            counts_RE = counts_RE.roll(1, dims=1)  # drifted routing for the second step
    if bad:
        raise AssertionError(f"{len(bad)} of {n} cases differ; first: {bad[:5]}")
    return {"cases": n}


def capture(fn: Callable[[], Fields]) -> tuple[torch.cuda.CUDAGraph, Fields]:
    """Warm up ``fn`` on a side stream, then capture it in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_section() -> dict[str, Any]:
    R, E, S, K = 8, 896, 8192, 8
    B = -(-E // R)
    static_RE = lognormal_counts(R, E, S, K, 0).cuda()
    prev_RB = torch.full((R, B), -1, dtype=torch.int64, device="cuda")
    prev_F3 = torch.full((R - 1, 3), -1, dtype=torch.int64, device="cuda")
    graph, out = capture(lambda: cuda_backend.plan_cuda(static_RE, B, 128, prev_RB, prev_F3))
    for seed in range(1, 6):
        counts_RE = lognormal_counts(R, E, S, K, seed)
        static_RE.copy_(counts_RE)
        want = reference_fields(counts_RE, B, 128, (prev_RB, prev_F3))
        graph.replay()
        torch.cuda.synchronize()
        keys = mismatches(out, want)
        if keys:
            raise AssertionError(f"replay {seed} differs from the reference in {keys}")
        prev_RB.copy_(out.slot_expert)
        prev_F3.copy_(out.flow)
    return {"replays_checked": 5}


def time_replay(graph: torch.cuda.CUDAGraph, n: int = REPLAYS) -> float:
    """Mean microseconds per replay (CUDA events around ``n`` back-to-back replays)."""
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / n


def time_eager(fn: Callable[[], Any], n: int = 50) -> float:
    """Mean wall microseconds per call of ``fn`` (host launch path included), synchronised."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1e6 / n


def timing_one(R: int, E: int, S: int, K: int) -> dict[str, Any]:
    B = -(-E // R)
    counts_RE = lognormal_counts(R, E, S, K, 7)
    static_RE = counts_RE.cuda()
    row: dict[str, Any] = {"R": R, "E": E, "S": S, "K": K, "B": B}
    graph, out = capture(lambda: cuda_backend.plan_cuda(static_RE, B, 128, None))
    row["cuda_us"] = round(time_replay(graph), 2)
    row["eager_us"] = round(time_eager(lambda: cuda_backend.plan_cuda(static_RE, B, 128, None)), 2)
    row["matches_reference"] = not mismatches(out, reference_fields(counts_RE, B, 128, None))
    try:
        from moonplan.plan.torch_backend import plan_torch

        tgraph, _ = capture(lambda: plan_torch(static_RE, B, 128, None))
        row["torch_us"] = round(time_replay(tgraph, 50), 2)
    except Exception as exc:
        row["torch_us"] = None
        row["torch_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return row


def timing_section() -> dict[str, Any]:
    rows = []
    for shape in SHAPES:
        try:
            rows.append(timing_one(*shape))
        except Exception as exc:
            rows.append(
                dict(zip("RESK", shape, strict=True), error=f"{type(exc).__name__}: {exc}"[:300])
            )
            traceback.print_exc()
    first = rows[0].get("cuda_us")
    return {
        "rows": rows,
        "target_us": TARGET_US,
        "meets_target": first is not None and first <= TARGET_US,
    }


KERNEL_SECTIONS = {"random": random_section, "graph": graph_section, "timing": timing_section}
"""The fused kernel's sections, in order (``gpu_check`` runs them where
``cuda_backend.available()``)."""


# ---- the public plan() per policy -------------------------------------------------------------
API_SHAPES = [(8, 256, 4096, 8), (8, 896, 8192, 8), (64, 896, 8192, 8)]
POLICIES = ("exact", "static", "resident", "bounded-0.1", "greedy", "auto")


def api_section(smoke: bool = False) -> dict[str, Any]:
    """``moonplan.plan(counts, policy=...)`` per policy and shape: eager microseconds, and
    CUDA-graph replay microseconds where the call can be captured (all eager rows first:
    a refused capture is the last thing a row does)."""
    dev = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    shapes = [(4, 16, 64, 2)] if smoke else API_SHAPES
    reps = 3 if smoke else 20
    rows = [_api_eager(shape, policy, dev, reps) for shape in shapes for policy in POLICIES]
    if dev.type == "cuda":
        for row in rows:
            _api_graph(row, dev)
    for row in rows:
        row.pop("fn", None)
    return {"device": str(dev), "rows": rows}


def _api_call(shape: tuple[int, ...], policy: str, dev: torch.device) -> Callable[[], Any]:
    """A ``plan()`` call on lognormal counts, with the previous step's plan as ``previous``."""
    import moonplan
    from moonplan.stepcost import StepCost

    R, E, S, K = shape
    B = min(2, -(-E // R))
    counts_RE = lognormal_counts(R, E, S, K, 7).to(dev)
    prev = moonplan.plan(lognormal_counts(R, E, S, K, 6).to(dev), slots=B, align=128)
    cost = StepCost.from_hardware("h200-node", "deepseek-v3") if policy == "auto" else None
    opts = {"slots": B, "align": 128, "previous": prev, "policy": policy, "cost": cost}
    return lambda: moonplan.plan(counts_RE, check_input=False, **opts)


def _api_eager(shape: tuple[int, ...], policy: str, dev: torch.device, reps: int) -> dict:
    row: dict[str, Any] = {"shape": list(shape), "policy": policy}
    try:
        row["fn"] = _api_call(shape, policy, dev)
        row["eager_us"] = round(time_eager(row["fn"], reps), 1)
    except Exception as exc:
        row["eager_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def _api_graph(row: dict, dev: torch.device) -> None:
    """Capture and replay ``row["fn"]``; note why not where the capture is refused."""
    fn = row.get("fn")
    if fn is None:
        return
    try:
        graph, _ = capture(fn)
        row["graph_us"] = round(time_replay(graph, 50), 1)
    except Exception as exc:
        row["graph_error"] = f"not capturable: {type(exc).__name__}: {exc}"[:300]
        torch.cuda.synchronize(dev)
