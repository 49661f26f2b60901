"""A slot table's score over the window in torch ops, every step at once
(``moonplan/plan/residency/window_torch.py``): the host form's floats, step for step.

Legend: S steps, R ranks, E experts, B slots per rank.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonplan.plan.home import home_list
from moonplan.plan.residency.target import served_s, step_time_over, window_s
from moonplan.plan.residency.window_torch import static_torch, window_torch, windows_torch
from moonplan.stepcost import StepCost
from tests.plan.choice.costs import costs


@st.composite
def windows(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """``(rows_SRE, slot_RB)``: 1-4 steps of random counts (cold, hot and empty experts)
    and a slot table that never holds a rank's own home expert or one expert twice."""
    R, E = draw(st.integers(1, 5)), draw(st.integers(1, 12))
    S, B = draw(st.integers(1, 4)), draw(st.integers(0, 3))
    flat = st.lists(st.integers(0, 300), min_size=S * R * E, max_size=S * R * E)
    rows_SRE = np.array(draw(flat), dtype=np.int64).reshape(S, R, E)
    home = home_list(E, R)
    table = []
    for r in range(R):
        pool = [e for e in range(E) if home[e] != r]
        picked = draw(st.lists(st.sampled_from(pool), unique=True, max_size=B)) if pool else []
        table.append(picked[:B] + [-1] * (B - len(picked[:B])))
    return rows_SRE, np.array(table, dtype=np.int64).reshape(R, B)


@given(windows(), costs())
@settings(deadline=None, max_examples=60)
def test_every_step_is_scored_as_the_host_scores_it(
    window: tuple[np.ndarray, np.ndarray], cost: StepCost
) -> None:
    """Random steps, tables and costs (either schedule, one or several domains, tiles of
    1-16 rows, cheap to prohibitive planning): each step's seconds equal ``served_s``'s,
    and summed in order they are ``window_s``."""
    rows_SRE, slot_RB = window
    S = rows_SRE.shape[0]
    empty_RB = np.full_like(slot_RB, -1)
    statics = [step_time_over(cost, c_RE, empty_RB) for c_RE in rows_SRE]
    want = [served_s(cost, c_RE, slot_RB, s) for c_RE, s in zip(rows_SRE, statics, strict=True)]
    static_S = torch.tensor(statics, dtype=torch.float64)
    got = window_torch(cost, torch.from_numpy(rows_SRE), static_S, torch.from_numpy(slot_RB))
    assert got.dtype == torch.float64 and got.shape == (S,)
    assert got.tolist() == want
    assert sum(got.tolist()) == window_s(cost, list(rows_SRE), statics, slot_RB)


@given(windows(), st.data(), costs())
@settings(deadline=None, max_examples=40)
def test_several_tables_at_once_score_as_each_alone(
    window: tuple[np.ndarray, np.ndarray], data: st.DataObject, cost: StepCost
) -> None:
    """1-4 tables scored in one call (empty ones among them, in any order): each table's
    row is the host's ``served_s`` of every step, as if scored alone."""
    rows_SRE, first_RB = window
    R, B = first_RB.shape
    tables = [first_RB, np.full_like(first_RB, -1)]
    for _ in range(data.draw(st.integers(0, 2))):
        tables.append(data.draw(st.permutations(list(first_RB.flatten()))))
    slot_TRB = np.stack([np.asarray(t, dtype=np.int64).reshape(R, B) for t in tables])
    slot_TRB = slot_TRB[data.draw(st.permutations(range(len(tables))))]
    empty_RB = np.full_like(first_RB, -1)
    statics = [step_time_over(cost, c_RE, empty_RB) for c_RE in rows_SRE]
    static_S = torch.tensor(statics, dtype=torch.float64)
    got = windows_torch(cost, torch.from_numpy(rows_SRE), static_S, torch.from_numpy(slot_TRB))
    assert got.shape == (len(tables), rows_SRE.shape[0])
    for t, slot_RB in enumerate(slot_TRB):
        want = [served_s(cost, c, slot_RB, s) for c, s in zip(rows_SRE, statics, strict=True)]
        assert got[t].tolist() == want, t


@given(windows(), costs())
@settings(deadline=None, max_examples=60)
def test_static_ep_is_scored_as_the_host_scores_it(
    window: tuple[np.ndarray, np.ndarray], cost: StepCost
) -> None:
    """Static EP's seconds of every step at once equal ``step_time_over`` over empty
    slots, step by step."""
    rows_SRE, slot_RB = window
    empty_RB = np.full_like(slot_RB, -1)
    want = [step_time_over(cost, c_RE, empty_RB) for c_RE in rows_SRE]
    got = static_torch(cost, torch.from_numpy(rows_SRE))
    assert got.dtype == torch.float64 and got.tolist() == want


def test_a_held_table_builds_the_resident_plan_where_the_exit_would() -> None:
    """Two ranks, one hot expert replicated on the other rank: the ``resident`` plan splits
    it, so the held table's step is faster than static EP's and equals the host's score;
    the empty table's is static EP's plus its planning (here a full call each step: the
    exit's bound says a copy pays)."""
    cost = StepCost.from_hardware("h200-node", "mixtral-8x7b", plan_us=60.0, exit_us=2.0)
    c_RE = np.array([[4000, 10, 10, 10], [4000, 10, 10, 10]], dtype=np.int64)
    held_RB = np.array([[-1], [0]], dtype=np.int64)
    empty_RB = np.full_like(held_RB, -1)
    static = step_time_over(cost, c_RE, empty_RB)
    rows = torch.from_numpy(c_RE[None])
    static_S = torch.tensor([static], dtype=torch.float64)
    held = float(window_torch(cost, rows, static_S, torch.from_numpy(held_RB))[0])
    empty = float(window_torch(cost, rows, static_S, torch.from_numpy(empty_RB))[0])
    assert held == served_s(cost, c_RE, held_RB, static) and held < static
    assert empty == served_s(cost, c_RE, empty_RB, static) == static + cost.plan_s
