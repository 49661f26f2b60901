"""moonplan.plan.reuse: the horizon measured from how long fetched replicas serve.

Legend: E experts, R ranks; ``alloc_ER`` int64 ``[E, R]``, ``fetch_ER`` bool ``[E, R]``.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moonplan.cost import get_preset
from moonplan.plan import plan
from moonplan.plan.ahead import AheadChoice, choose_next, executed
from moonplan.plan.reuse import ReplicaLife
from moonplan.stepcost import StepCost, plan_fetch_ER

E, R = 6, 4


def _step(pairs: list[tuple[int, int]], fetched: list[tuple[int, int]]) -> tuple:
    """An executed step using ``pairs`` (one record each), of which ``fetched`` were fetched."""
    alloc_ER = np.zeros((E, R), dtype=np.int64)
    fetch_ER = np.zeros((E, R), dtype=bool)
    for e, r in pairs:
        alloc_ER[e, r] = 1
    for e, r in fetched:
        fetch_ER[e, r] = True
    return alloc_ER, fetch_ER


def test_before_any_fetch_is_followed_the_horizon_is_the_cap() -> None:
    life = ReplicaLife()
    assert life.horizon(8.0) == 8.0 and life.survival() is None
    life.observe(*_step([(0, 1)], [(0, 1)]))  # fetched, not yet followed a step
    assert life.horizon(8.0) == 8.0


def test_replicas_that_serve_exactly_two_steps_give_two() -> None:
    """Every step fetches a new replica that is used once more, then dropped: each fetch
    serves 2 steps (q_0 = 1, q_1 = 0)."""
    life = ReplicaLife()
    for t in range(12):
        e_new, e_old = t % E, (t - 1) % E
        pairs = [(e_new, 1)] + ([(e_old, 1)] if t else [])
        life.observe(*_step(pairs, [(e_new, 1)]))
    assert life.survival() == pytest.approx([1.0, 0.0, 0.0])
    assert life.horizon(8.0) == pytest.approx(2.0)


def test_direct_reads_fetched_every_step_give_one() -> None:
    """A replica read directly is fetched again every step it is used: it never survives."""
    life = ReplicaLife()
    for _ in range(6):
        life.observe(*_step([(2, 3)], [(2, 3)]))
    assert life.horizon(8.0) == 1.0


def test_replicas_kept_for_good_give_the_cap() -> None:
    life = ReplicaLife()
    life.observe(*_step([(0, 1), (1, 2)], [(0, 1), (1, 2)]))
    for _ in range(6):
        life.observe(*_step([(0, 1), (1, 2)], []))
    assert life.horizon(8.0) == 8.0 and life.horizon(3.0) == 3.0


def _lifetimes_horizon(lives: list[int], cap: int) -> float:
    """Reference: the mean of ``min(life, cap)`` over fetches of known lifetimes."""
    return float(np.mean([min(n, cap) for n in lives]))


@given(st.lists(st.integers(1, 3), min_size=1, max_size=6))
def test_without_decay_a_followed_replica_gives_its_lifetime(lives: list[int]) -> None:
    """With ``decay = 0`` the last step's survival only: a single replica fetched with a
    lifetime ``n`` and followed to its end measures ``h`` as the reference counts it
    while all ages stay within the pooled bucket (``n <= 3``). With the default decay
    every horizon lies in ``[1, cap]``."""
    for n in lives:
        life = ReplicaLife(decay=0.0)
        steps = [_step([(0, 1)], [(0, 1)])] + [_step([(0, 1)], [])] * (n - 1) + [_step([], [])]
        for s in steps:
            life.observe(*s)
        assert life.horizon(8.0) == pytest.approx(_lifetimes_horizon([n], 8))
    life = ReplicaLife()
    for n in lives:
        for s in [_step([(0, 1)], [(0, 1)])] + [_step([(0, 1)], [])] * (n - 1):
            life.observe(*s)
    assert 1.0 <= life.horizon(8.0) <= 8.0


def test_checks_and_resets() -> None:
    with pytest.raises(ValueError, match="decay"):
        ReplicaLife(decay=1.0)
    life = ReplicaLife()
    with pytest.raises(ValueError, match="shape"):
        life.observe(np.zeros((E, R)), np.zeros((E, R + 1), dtype=bool))
    with pytest.raises(ValueError, match="cap"):
        life.horizon(0.5)
    for _ in range(3):
        life.observe(*_step([(2, 3)], [(2, 3)]))
    assert life.horizon(8.0) == 1.0
    life.observe(np.zeros((E + 1, R)), np.zeros((E + 1, R), dtype=bool))  # a new shape
    assert life.horizon(8.0) == 8.0
    life.observe(*_step([(2, 3)], [(2, 3)]))
    life.reset()
    assert life.survival() is None


def test_executed_is_the_plans_used_and_fetched_pairs() -> None:
    """``executed``, from the fetch list's rows alone: the replicas off their home the
    plan sends records to (``alloc > 0``) and those it copies (``plan_fetch_ER``)."""
    cost = StepCost.from_hardware("h200-node", get_preset("deepseek-v3"))
    g = np.random.default_rng(0)
    prev = None
    for B in (2, 2, 0, 1):
        counts = g.integers(0, 40, size=(R, 8)) * (g.random((R, 8)) < 0.5)
        p = plan(counts, previous=prev if B == 2 else None, policy="exact", cost=cost, slots=B)
        used_ER, fetch_ER = executed(p)
        off_home_ER = np.ones((8, R), dtype=bool)
        off_home_ER[np.arange(8), p.home.numpy()] = False
        assert np.array_equal(used_ER, (p.alloc.numpy() > 0) & off_home_ER)
        assert np.array_equal(fetch_ER, plan_fetch_ER(p).numpy())
        prev = p


def test_the_search_scores_with_the_measured_horizon() -> None:
    """``AheadChoice.search_cost``: ``cost`` with the measured horizon; ``update`` runs the
    search with it; a cost model without a horizon field is passed as it is."""
    cost = StepCost.from_hardware("h200-node", get_preset("deepseek-v3"))
    ahead = AheadChoice()
    assert ahead.search_cost(cost) == cost  # nothing measured: the cap
    for _ in range(4):
        ahead.life.observe(*_step([(2, 3)], [(2, 3)]))
    measured = ahead.search_cost(cost)
    assert measured.horizon == 1.0 and dataclasses.replace(measured, horizon=cost.horizon) == cost

    class Plain:
        def step_time(self, *a: object, **k: object) -> None: ...

    plain = Plain()
    assert ahead.search_cost(plain) is plain
    # update() searches with search_cost(cost): the choice choose_next makes with the
    # horizon measured on every plan recorded so far, this step's included
    g = np.random.default_rng(1)
    counts = [g.integers(0, 60, size=(8, 32)) * (g.random((8, 32)) < 0.4) for _ in range(5)]
    ahead, prev, life, searched = AheadChoice(), None, ReplicaLife(), 0
    for c in counts:
        p = plan(c, previous=prev, policy=ahead.policy(), cost=cost, backend="torch")
        start = ahead.start(prev)
        life.observe(*executed(p))
        found = ahead.update(c, p, previous=prev, cost=cost)
        if found is not None:
            want = dataclasses.replace(cost, horizon=life.horizon(cost.horizon))
            assert found == choose_next(c, start, cost=want)
            searched += 1
        prev = p
    assert searched >= 3


class DenseLife:
    """Reference: the ages of every ``(e, r)`` pair in a dense array (-1: none), the
    survival counts per age bucket kept as :class:`ReplicaLife` keeps them."""

    def __init__(self) -> None:
        self.age_ER: np.ndarray | None = None
        self.live = [0.0] * 3
        self.kept = [0.0] * 3

    def observe(self, alloc_ER: np.ndarray, fetch_ER: np.ndarray) -> None:
        used_ER = alloc_ER > 0
        if self.age_ER is None:
            self.age_ER = np.full(used_ER.shape, -1, dtype=np.int64)
        live_ER = self.age_ER >= 0
        kept_ER = live_ER & used_ER & ~fetch_ER
        for a in range(3):
            at_ER = live_ER & (np.minimum(self.age_ER, 2) == a)
            if at_ER.sum():
                self.live[a] = 0.7 * self.live[a] + int(at_ER.sum())
                self.kept[a] = 0.7 * self.kept[a] + int((at_ER & kept_ER).sum())
        self.age_ER = np.where(kept_ER, self.age_ER + 1, -1)
        self.age_ER[fetch_ER] = 0


@given(st.integers(0, 2**31 - 1), st.integers(1, 12))
def test_sparse_observe_equals_the_dense_reference(seed: int, steps: int) -> None:
    """Random steps (replicas used or not, fetched or not, some re-fetched while live):
    the same survival counts as the dense reference, so the same horizon."""
    g = np.random.default_rng(seed)
    fast, ref = ReplicaLife(), DenseLife()
    for _ in range(steps):
        alloc_ER = g.integers(0, 3, size=(E, R)) * (g.random((E, R)) < 0.5)
        fetch_ER = (alloc_ER > 0) & (g.random((E, R)) < 0.3)
        fast.observe(alloc_ER, fetch_ER)
        ref.observe(alloc_ER, fetch_ER)
        assert fast._live == pytest.approx(ref.live) and fast._kept == pytest.approx(ref.kept)
        assert fast.horizon(8.0) == pytest.approx(
            ReplicaLife.horizon(_with_counts(ref.live, ref.kept), 8.0)
        )


def _with_counts(live: list[float], kept: list[float]) -> ReplicaLife:
    life = ReplicaLife()
    life._live, life._kept = list(live), list(kept)
    return life
