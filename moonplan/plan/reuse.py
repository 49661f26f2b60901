"""How long fetched replicas are used: the horizon ``auto`` spreads a fetch over, measured.

Legend:
    R ranks, E experts
    alloc_ER  int64 [E, R] records each rank executes of each expert (a plan's ``alloc``)
    fetch_ER  bool [E, R] pairs whose weights the plan moved this step (new slots, direct
              reads: ``moonplan.stepcost.plan_fetch_ER``)
    age_ER    int64 [E, R] steps a fetched replica has served since its fetch (-1: none)

``policy="auto"`` charges a step ``1 / horizon`` of the fetch it waits for
(``moonplan.plan.choose.score``): a copy made now serves the steps its replica stays in
use. ``StepCost.horizon`` assumes 8 steps. On drifting skewed routing a fetched replica
is used for 1.1-2.5 steps (measured on the acceptance sweep's traces at EP 64), and a
fetch spread over 8 looks 3-7x cheaper than it is.

:class:`ReplicaLife` measures it from the plans a layer executes. A fetched pair
*survives* a step when the next plan still executes the expert on that rank without
fetching it again (a direct read, fetched every step, never survives). Per age (0, 1,
2 and older pooled) it keeps a decayed count of the live pairs and of those that
survived, ``q_a = survived_a / live_a``, and the expected steps a fetch serves are
``h = 1 + q_0 + q_0 q_1 + q_0 q_1 q_2 + ...`` (``cap - 1`` terms, ``q_2`` for every age
from 2 on: at most ``cap``). Before any fetched pair has been followed, ``h = cap``.

Every input is a plan every rank computes alike, so every rank measures the same
horizon. Measured on the acceptance sweep (``docs/planner-policy.md``, "The horizon,
measured").
"""

from __future__ import annotations

import numpy as np

AGES = 3
"""Age buckets: 0, 1, and 2 or older."""

DECAY = 0.7
"""Weight of the past per observed step (a fetch 5 steps back counts 0.17 of a new one)."""


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
        self._age_ER: np.ndarray | None = None
        self._live = [0.0] * AGES
        self._kept = [0.0] * AGES

    def observe(self, alloc_ER: np.ndarray, fetch_ER: np.ndarray) -> None:
        """One executed step: its allocation ``alloc_ER`` (int ``[E, R]``) and fetched
        pairs ``fetch_ER`` (bool ``[E, R]``). A shape change starts over."""
        used_ER = np.asarray(alloc_ER) > 0
        fetch_ER = np.asarray(fetch_ER, dtype=bool)
        if used_ER.shape != fetch_ER.shape:
            raise ValueError(f"alloc {used_ER.shape} and fetch {fetch_ER.shape} differ in shape")
        if self._age_ER is None or self._age_ER.shape != used_ER.shape:
            self.reset()
            self._age_ER = np.full(used_ER.shape, -1, dtype=np.int64)
        age_ER = self._age_ER
        live_ER = age_ER >= 0
        kept_ER = live_ER & used_ER & ~fetch_ER
        bucket_ER = np.minimum(age_ER, AGES - 1)
        for a in range(AGES):
            at_ER = live_ER & (bucket_ER == a)
            n = int(at_ER.sum())
            if n:
                self._live[a] = self.decay * self._live[a] + n
                self._kept[a] = self.decay * self._kept[a] + int((at_ER & kept_ER).sum())
        self._age_ER = np.where(kept_ER, age_ER + 1, -1)
        self._age_ER[fetch_ER] = 0

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
        for k in range(max(0, int(cap) - 1)):
            surv *= q[min(k, AGES - 1)]
            h += surv
        return float(min(cap, max(1.0, h)))
