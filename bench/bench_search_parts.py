"""Host cost of the numeric parts ``policy="auto"``'s search calls, and of one whole choice.

Legend: R ranks (EP), S tokens per rank; DeepSeek-V3 (E=256, top-8) on ``h200-node``
(the simulator's ``moonplan-auto`` cost), sigma 1, the second step of a drifting trace
with the first step's ``policy="auto"`` plan as ``previous`` (torch builder, CPU).

Parts (each one call, as a choice makes it):

* ``step``: ``screen.Step.of`` (the host view every bound of a choice shares);
* ``views``: every host view of one lean choice: ``Step.of`` and the scores'
  ``score_alloc.Context`` (from that step where the tree has ``Context.of_step``,
  else ``Context.of``, which reads the counts and ``previous`` again);
* ``bound``: one ``screen.lower_bound`` of the exact candidate with that shared step;
* ``score``: ``StepCost.plan_time`` of the exact plan (one candidate's predicted step);
* ``construct``: ``choose.build("exact", inputs)`` (one group-flow construction);
* ``alloc``: ``torch_backend.alloc_torch`` (steps 1-2 alone: the greedy candidate);
* ``home_map``: ``home.home_map(E, R)``;
* ``choose``: ``choose.choose(inputs, cost)`` (a whole full choice);
* ``search``: ``search.search(inputs, cost)`` (the lean choose-ahead search: a full
  choice by name, nothing laid out).

Each sample times a batch of calls (``--batch``: enough for the timer); the table holds
the median of ``--reps`` samples (at least 15), in microseconds per call. Run with
``OMP_NUM_THREADS=1`` (torch's thread pool slows small ops on a shared machine).

``--compare TREE`` runs every part in two worker processes, one importing ``moonplan``
from ``TREE`` (another checkout: the code before a change) and one from this
checkout, alternating one sample of each (a busy machine slows both alike), and prints
``old/new`` per part; it also checks that both trees give the same results (the bound's
and the score's floats, the plan's tensors, the choice) and says so per case.
``--compare-rev REV`` does the same against this repository's commit ``REV``, unpacked
(``git archive``) into a temporary folder: a fixed base, where a shared checkout may
move on while the benchmark runs::

    OMP_NUM_THREADS=1 python bench/bench_search_parts.py --compare-rev main \\
        [--reps 15] [--out bench/results/search_parts.json]
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PARTS = ("step", "views", "bound", "score", "construct", "alloc", "home_map", "choose", "search")
VIEWS = ("step", "views")  # host views: their fields may change, so no digest compared
CASES = [(8, 16), (8, 256), (8, 4096), (64, 16), (64, 256), (64, 4096)]
QUICK = [(8, 256), (64, 256)]


def make_parts(R: int, S: int) -> dict[str, Callable[[], Any]]:
    """The parts of one case as calls (imports ``moonplan`` from ``sys.path``)."""
    from moonplan.plan.api import plan
    from moonplan.plan.choose import Inputs, build, choose, horizon_of
    from moonplan.plan.home import home_map
    from moonplan.plan.score_alloc import Context
    from moonplan.plan.screen import Step, lower_bound
    from moonplan.plan.search import search
    from moonplan.plan.torch_backend import alloc_torch
    from moonplan.simulate.model_time import SimConfig
    from moonplan.simulate.models import get_model
    from moonplan.simulate.workload import drifting_counts
    from moonplan.stepcost.hardware import get_hardware

    m = get_model("deepseek-v3")
    cost = SimConfig().step_cost(m, get_hardware("h200-node"), "moonplan-auto")
    c0, c = drifting_counts(R, m.num_experts, S, m.top_k, sigma=1.0, steps=2, seed=0)
    prev = plan(c0, policy="auto", cost=cost, backend="torch")
    prev_RB, prev_F3 = prev.slot_expert, prev.flow
    inp = Inputs(c, prev.num_slots, 1, prev_RB, prev_F3, "torch", prev.policy)
    step = Step.of(c, prev_RB, prev_F3)
    exact = build("exact", inp)
    h = horizon_of(cost)
    E = c.shape[1]

    def views() -> Any:
        st = Step.of(c, prev_RB, prev_F3)
        if hasattr(Context, "of_step"):
            return st, Context.of_step(st, prev_RB, prev_F3)
        return st, Context.of(c, prev_RB, prev_F3)

    def bound() -> float:
        kw = {"prev_RB": prev_RB, "prev_F3": prev_F3}  # exact balance: target None
        return lower_bound(cost, c, 0, horizon=h, step=step, **kw)

    return {
        "step": lambda: Step.of(c, prev_RB, prev_F3),
        "views": views,
        "bound": bound,
        "score": lambda: cost.plan_time(exact, planned=1),
        "construct": lambda: build("exact", inp),
        "alloc": lambda: alloc_torch(c, prev_RB, prev_F3),
        "home_map": lambda: home_map(E, R),
        "choose": lambda: choose(inp, cost),
        "search": lambda: search(inp, cost),
    }


def digest(value: Any) -> str:
    """A short fingerprint of a part's result (floats by ``repr``, tensors by values)."""
    import torch

    def plain(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return [str(v.dtype), v.tolist()]
        if hasattr(v, "alloc"):  # a Plan: its tensors, policy, runs and scores
            keys = ("alloc", "slot_expert", "slot_new", "row_expert", "row_count", "flow")
            extra = [v.policy, v.planned, sorted(dict(v.predicted or {}).items())]
            return [plain(getattr(v, k)) for k in keys] + [repr(extra)]
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return repr(v)

    text = json.dumps(plain(value), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def sample_us(fn: Callable[[], Any], batch: int) -> float:
    """Microseconds per call of one batch of ``batch`` calls."""
    t0 = time.perf_counter()
    for _ in range(batch):
        fn()
    return (time.perf_counter() - t0) / batch * 1e6


def batch_of(part: str, R: int, S: int) -> int:
    """Calls per sample: more for the short parts, so each sample lasts a few
    milliseconds (a burst of other load then spreads over many calls)."""
    return {"home_map": 200, "bound": 20, "score": 10, "step": 20, "views": 10, "alloc": 8}.get(
        part, 3
    )


def worker() -> None:
    """Answer ``R S part`` lines on stdin with a JSON line ``{"us": ..., "digest": ...}``
    (``part == "digest"``: every part's result fingerprint)."""
    cache: dict[tuple[int, int], dict[str, Callable[[], Any]]] = {}
    for line in sys.stdin:
        R_, S_, part = line.split()
        key = (int(R_), int(S_))
        if key not in cache:
            cache[key] = make_parts(*key)
            for fn in cache[key].values():  # warm-up
                fn()
        parts = cache[key]
        if part == "digest":
            kept = {p: fn for p, fn in parts.items() if p not in VIEWS}
            out: dict[str, Any] = {"digest": {p: digest(fn()) for p, fn in kept.items()}}
        else:
            out = {"us": sample_us(parts[part], batch_of(part, *key))}
        print(json.dumps(out), flush=True)


class Worker:
    """One worker process importing ``moonplan`` from ``tree``."""

    def __init__(self, tree: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"]
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tree
        )

    def ask(self, R: int, S: int, part: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{R} {S} {part}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker for {part} at R={R} S={S} stopped")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run(cases: list[tuple[int, int]], reps: int, compare: Path | None) -> list[dict[str, Any]]:
    """Per case and part the median microseconds (and, comparing, old's and the ratio)."""
    new = Worker(ROOT)
    old = Worker(compare) if compare is not None else None
    rows = []
    try:
        for R, S in cases:
            row: dict[str, Any] = {"R": R, "S": S}
            if old is not None:  # the views' fields may change (VIEWS); the rest may not
                a, b = old.ask(R, S, "digest")["digest"], new.ask(R, S, "digest")["digest"]
                row["differ"] = sorted(p for p in a if a[p] != b[p])
                row["same"] = not row["differ"]
            for part in PARTS:
                new_us, old_us = [], []
                for _ in range(reps):
                    if old is not None:
                        old_us.append(old.ask(R, S, part)["us"])
                    new_us.append(new.ask(R, S, part)["us"])
                row[f"{part}_us"] = statistics.median(new_us)
                row[f"{part}_min_us"] = min(new_us)
                if old is not None:
                    row[f"{part}_old_us"] = statistics.median(old_us)
                    row[f"{part}_ratio"] = row[f"{part}_old_us"] / row[f"{part}_us"]
                    row[f"{part}_old_min_us"] = min(old_us)  # least disturbed by others
                    row[f"{part}_min_ratio"] = min(old_us) / min(new_us)
            rows.append(row)
            print(table_lines([row], compare is not None)[-1], flush=True)
    finally:
        new.close()
        if old is not None:
            old.close()
    return rows


def table_lines(rows: list[dict[str, Any]], compare: bool) -> list[str]:
    """Markdown: per case, each part's microseconds (``old / new = ratio`` comparing, then
    the ratios of the fastest samples: what a quiet machine would show)."""
    head = "| R | S | " + " | ".join(PARTS) + (" | same results |" if compare else " |")
    lines = [head, "|" + "---|" * (len(PARTS) + 2 + compare)]
    if not compare:
        for r in rows:
            cells = [f"{r[f'{p}_us']:.0f}" for p in PARTS]
            lines.append(f"| {r['R']} | {r['S']} | " + " | ".join(cells) + " |")
        return lines
    best = ["", "Fastest samples, old / new:", "", *lines]
    for r in rows:
        cells = [
            f"{r[f'{p}_old_us']:.0f} / {r[f'{p}_us']:.0f} = {r[f'{p}_ratio']:.2f}x" for p in PARTS
        ]
        same = "yes" if r["same"] else f"NO: {', '.join(r['differ'])}"
        lines.append(f"| {r['R']} | {r['S']} | " + " | ".join(cells) + f" | {same} |")
        ratios = [f"{r[f'{p}_min_ratio']:.2f}x" for p in PARTS]
        best.append(f"| {r['R']} | {r['S']} | " + " | ".join(ratios) + f" | {same} |")
    return lines + best


def unpack(rev: str, into: Path) -> Path:
    """This repository's commit ``rev`` unpacked under ``into`` (``git archive``): a tree
    to import ``moonplan`` from."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", sha], check=True, capture_output=True)
    tree = into / sha[:12]
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as archive:
        archive.extractall(tree, filter="data")
    print(f"comparing with {rev} ({sha[:12]}) unpacked in {tree}")
    return tree


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    sys.path.insert(0, str(HERE))
    from _common import timing_parser, write_report

    ap = timing_parser(__doc__, reps=15, out="bench/results/search_parts.json")
    ap.add_argument("--compare", default=None, help="another checkout: time it side by side")
    ap.add_argument("--compare-rev", default=None, help="a commit of this repository, likewise")
    args = ap.parse_args()
    if args.reps < 15:
        ap.error("--reps must be at least 15 (medians of fewer samples are too noisy here)")
    with tempfile.TemporaryDirectory() as tmp:
        if args.compare_rev:
            compare: Path | None = unpack(args.compare_rev, Path(tmp))
        else:
            compare = Path(args.compare).resolve() if args.compare else None
        t0 = time.perf_counter()
        rows = run(QUICK if args.quick else CASES, args.reps, compare)
    unit = "microseconds per call, median"
    md = [
        f"# Search parts ({unit}{'; old / new = old/new' if compare else ''})",
        "",
        *table_lines(rows, compare is not None),
    ]
    result = {
        "rows": rows,
        "reps": args.reps,
        "compare": args.compare_rev or (str(compare) if compare else None),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "seconds": time.perf_counter() - t0,
    }
    write_report(args.out, result, md)


if __name__ == "__main__":
    main()
