"""Drawing helpers shared by the planner tests (hypothesis, and ``random.Random`` sweeps).

Legend: R ranks, E experts; counts int64 ``[R, E]``.
"""

from __future__ import annotations

import random

import torch
from hypothesis import strategies as st

from moonplan.testing import counts


def counts_like(data: st.DataObject, c: torch.Tensor) -> torch.Tensor:
    """Counts drawn with the shape ``[R, E]`` of ``c`` (a later step of the same layer)."""
    R, E = c.shape
    return data.draw(counts(min_ranks=R, max_ranks=R, min_experts=E, max_experts=E))


def random_counts(
    rng: random.Random, R: int, E: int, *, hot_max: int, picks_max: int, uniform: bool = False
) -> torch.Tensor:
    """Counts of one kind drawn from ``rng``: ``lognormal`` (twice as likely as each other
    kind: each rank routes fewer than ``picks_max`` records by a lognormal popularity),
    ``hot`` (one expert, fewer than ``hot_max`` records from each rank), ``zero``,
    ``empty`` (lognormal with about half the ranks sending nothing) and, with ``uniform``,
    ``random`` (every entry uniform below 100)."""
    c = torch.zeros(R, E, dtype=torch.int64)
    kinds = ["lognormal", "lognormal", "hot", "zero", "empty"] + (["random"] if uniform else [])
    kind = rng.choice(kinds)
    if kind == "hot":
        c[:, rng.randrange(E)] = torch.tensor([rng.randrange(0, hot_max) for _ in range(R)])
    elif kind == "random":
        c = torch.tensor([[rng.randrange(100) for _ in range(E)] for _ in range(R)])
    elif kind != "zero":
        w = [rng.lognormvariate(0, 1.5) for _ in range(E)]
        for s in range(R):
            if kind == "empty" and rng.random() < 0.5:
                continue
            for e in rng.choices(range(E), weights=w, k=rng.randrange(0, picks_max)):
                c[s, e] += 1
    return c


def hot_steps(
    steps: int,
    ranks: int,
    experts: int,
    hot: tuple[int, ...],
    *,
    low: int,
    high: int,
    extra: int,
    seed: int = 0,
) -> list[torch.Tensor]:
    """``steps`` counts ``[ranks, experts]``: uniform in ``[low, high)``, each hot expert
    ``extra`` more from every rank (a persistent hot set over noise)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        c = torch.randint(low, high, (ranks, experts), generator=gen)
        c[:, list(hot)] += extra
        out.append(c)
    return out
