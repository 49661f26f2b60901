"""How long fetched replicas are used: the horizon ``auto`` spreads a fetch over, measured.

Legend:
    R ranks, E experts
    used_ER   bool [E, R] pairs a plan sends records to (``alloc > 0``)
    fetch_ER  bool [E, R] those whose weights it copies this step: its new slots and its
              direct rows (``moonplan.plan.ahead.executed``)
    live_L    int64 [L] the live fetched pairs, as flat ``e * R + r`` indices
    age_L     int64 [L] steps each has served since its fetch

``policy="auto"`` charges a step ``1 / horizon`` of the fetch it waits for
(``moonplan.plan.choose.score``): a copy made now serves the steps its replica stays in
use. ``StepCost.horizon`` assumes 8 steps. On drifting skewed routing a fetched replica
is used for 1.1-2.5 steps (measured on the acceptance sweep's traces at EP 64), and a
fetch spread over 8 looks 3-7x cheaper than it is.

:class:`ReplicaLife` measures it from the plans a layer executes. A fetched pair
*survives* a step when the next plan still sends it records without copying it again
(a direct row, copied every step, never survives; a replica kept in its slot but sent
nothing does not count as serving: measured both ways on the acceptance sweep, counting
held slots kept the horizon near its cap and lost most of the gain). Per age (0, 1,
2 and older pooled) it keeps a decayed count of the live pairs and of those that
survived, ``q_a = survived_a / live_a``, and the expected steps a fetch serves are
``h = 1 + q_0 + q_0 q_1 + q_0 q_1 q_2 + ...`` (``cap - 1`` terms, ``q_2`` for every age
from 2 on: at most ``cap``). Before any fetched pair has been followed, ``h = cap``.

Every input is a plan every rank computes alike, so every rank measures the same
horizon. Measured on the acceptance sweep (``docs/planner-policy.md``, "The horizon,
measured").
"""

from __future__ import annotations

import math

import numpy as np

AGES = 3
"""Age buckets: 0, 1, and 2 or older."""

DECAY = 0.7
"""Weight of an age bucket's past counts each time that bucket has live pairs to count
(over 5 such steps, 0.17)."""


OBSERVE_WORK = 0.1
"""One step's update of the measure, in construction equivalents: the used and copied
pairs from the plan's host rows (``moonplan.plan.ahead.executed_rows``; the rows are the
fetch list's read, which every policy pays: 22-23 µs) and :meth:`ReplicaLife.observe`,
78-142 µs against a construction's 805-1766 µs on this project's CPU (EP 8 x 256 experts
to EP 64 x 896: 0.071-0.097, rounded up), measured 2026-11-30. Choosing ahead it runs in
the search's thread, each search job first observing the steps since the last (the
simulator adds it to that search's work); choosing inline, on the critical path."""


class ReplicaLife:
    """Decayed survival of fetched replicas per age, and the horizon it gives (module
    docstring). Feed it each executed step's plan with :meth:`observe`."""

    def __init__(self, decay: float = DECAY) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.decay = float(decay)
        self.reset()

    def reset(self) -> None:
        """Forget every observation (the horizon is the cap again)."""
        self._shape: tuple[int, ...] | None = None
        self._live_L = np.zeros(0, dtype=np.int64)  # flat (e, r) index of each live pair
        self._age_L = np.zeros(0, dtype=np.int64)  # its age
        self._live = [0.0] * AGES
        self._kept = [0.0] * AGES

    def observe(self, used_ER: np.ndarray, fetch_ER: np.ndarray) -> None:
        """One executed step: the pairs it sends records to ``used_ER`` and copies
        ``fetch_ER`` (bool, or ints read as ``> 0``, ``[E, R]``). A shape change starts
        over.

        Only the live fetched pairs are followed (a few per rank, not ``E * R``): one
        pass over ``fetch_ER`` for its fetched pairs, a gather of ``used_ER`` at the
        live ones (``tests/plan/test_reuse.py`` checks it against a dense reference)."""
        used_ER, fetch_ER = np.asarray(used_ER), np.asarray(fetch_ER, dtype=bool)
        if used_ER.shape != fetch_ER.shape:
            raise ValueError(f"used {used_ER.shape} and fetch {fetch_ER.shape} differ in shape")
        if self._shape != used_ER.shape:
            self.reset()
            self._shape = used_ER.shape
        fetch_F = np.flatnonzero(fetch_ER)
        live_L, age_L = self._live_L, self._age_L
        kept_L = (used_ER.reshape(-1)[live_L] > 0) & ~np.isin(live_L, fetch_F)
        bucket_L = np.minimum(age_L, AGES - 1)
        live_A = np.bincount(bucket_L, minlength=AGES)
        kept_A = np.bincount(bucket_L[kept_L], minlength=AGES)
        for a in range(AGES):
            if live_A[a]:
                self._live[a] = self.decay * self._live[a] + int(live_A[a])
                self._kept[a] = self.decay * self._kept[a] + int(kept_A[a])
        self._live_L = np.concatenate([live_L[kept_L], fetch_F])
        self._age_L = np.concatenate([age_L[kept_L] + 1, np.zeros(len(fetch_F), np.int64)])

    def survival(self) -> list[float] | None:
        """``q_a`` per age bucket (an unobserved bucket takes the younger one's), or
        ``None`` before any fetched pair has been followed a step."""
        if self._live[0] <= 0:
            return None
        q, last = [], 1.0
        for a in range(AGES):
            if self._live[a] > 0:
                last = self._kept[a] / self._live[a]
            q.append(last)
        return q

    def horizon(self, cap: float) -> float:
        """Expected steps a fetch serves, in ``[1, cap]`` (``cap`` before any
        observation)."""
        if not cap >= 1.0:
            raise ValueError(f"cap must be >= 1, got {cap!r}")
        q = self.survival()
        if q is None:
            return float(cap)
        h, surv = 1.0, 1.0
        for k in range(max(0, math.ceil(cap) - 1)):
            surv *= q[min(k, AGES - 1)]
            h += surv
        return float(min(cap, max(1.0, h)))
