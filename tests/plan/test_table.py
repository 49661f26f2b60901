"""The candidate table of ``policy=``/``auto`` (``choose.TABLE``): one entry per candidate.

Legend: R ranks, E experts; a toy candidate is registered in a test's own table (the
module's table is immutable).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch

import moonplan
from moonplan import PlanError, check_plan
from moonplan.plan.candidates import bounded_targets
from moonplan.plan.choose import (
    CANDIDATES,
    TABLE,
    Candidate,
    Inputs,
    Targets,
    build,
    choose,
    screened_order,
)
from moonplan.plan.placement import static_alloc
from moonplan.plan.plan_type import Plan
from moonplan.traces import DriftingTrace
from tests.plan.test_policy import COMPUTE_ONLY

FREE = COMPUTE_ONLY  # only the busiest rank's rows cost: copies, traffic, planning free


def _toy_targets(load: list[int], inp: Inputs | None) -> Targets:
    return bounded_targets(load, Fraction(1, 2))


def _toy_build(inp: Inputs) -> Plan:
    return dataclasses.replace(build("bounded-0.5", inp), policy="toy")


TOY = Candidate("toy", _toy_build, targets=_toy_targets)
"""A balancing candidate: every load at most 1.5x the mean (one builder, one entry)."""


def _inputs(c: torch.Tensor) -> Inputs:
    R, E = c.shape
    return Inputs(c, -(-E // R), 1, None, None, "torch")


def _skewed() -> torch.Tensor:
    return DriftingTrace(8, 32, 256, 4, sigma=2.0, seed=5).step()


def test_a_toy_candidate_is_one_entry() -> None:
    c = _skewed()
    inp = _inputs(c)
    load = static_alloc(c).sum(0).tolist()
    assert max(load) > 1.5 * sum(load) / len(load)  # the toy has records to move
    table = (TABLE[0], TOY)  # static and the toy
    assert [n for n, _, _ in screened_order(load, inp, table)] == ["toy"]
    p = choose(inp, FREE, table)
    assert p.policy == "toy" and set(p.predicted) == {"static", "toy"} and p.planned == 1
    assert p.load_bound == bounded_targets(load, Fraction(1, 2))[1]
    check_plan(p, c)
    assert torch.equal(build("toy", inp, table).alloc, p.alloc)
    # beside the real candidates: evaluated (scored or screened), after the table's own
    q = choose(inp, FREE, (*TABLE, TOY))
    assert "toy" in [n for n, _, _ in screened_order(load, inp, (*TABLE, TOY))]
    assert q.predicted[q.policy] <= p.predicted["toy"]


def test_auto_skips_an_entry_not_marked_auto() -> None:
    c = _skewed()
    inp = _inputs(c)
    table = (TABLE[0], dataclasses.replace(TOY, auto=False))
    p = choose(inp, FREE, table)
    assert p.policy == "static" and set(p.predicted) == {"static"}
    assert build("toy", inp, table).policy == "toy"  # policy="toy" still builds it


def test_the_module_table_is_unchanged_by_a_test_table() -> None:
    choose(_inputs(_skewed()), FREE, (*TABLE, TOY))
    assert "toy" not in CANDIDATES and isinstance(TABLE, tuple)
    assert CANDIDATES == ("static", "resident", "bounded-0.25", "bounded-0.1",
                          "bounded-0.05", "exact", "greedy")  # fmt: skip
    with pytest.raises(PlanError, match="unknown policy"):
        moonplan.plan(_skewed(), policy="toy")


def test_a_fetchless_entry_equal_to_an_earlier_one_is_left_out() -> None:
    c = _skewed()
    twin = Candidate("twin", TABLE[0].build, alloc=lambda inp: static_alloc(inp.counts_RE))
    p = choose(_inputs(c), FREE, (TABLE[0], twin))
    assert set(p.predicted) == {"static"}


def _counted(cand: Candidate, calls: list[str]) -> Candidate:
    """``cand`` with its builder and allocation recording each call."""

    def build_(inp: Inputs) -> Plan:
        calls.append(f"build {cand.name}")
        return cand.build(inp)

    def alloc_(inp: Inputs) -> torch.Tensor | None:
        calls.append(f"alloc {cand.name}")
        assert cand.alloc is not None
        return cand.alloc(inp)

    return dataclasses.replace(cand, build=build_, alloc=alloc_)


@pytest.mark.parametrize("with_previous", [False, True])
def test_a_fetchless_winner_is_its_scored_allocation_laid_out(with_previous: bool) -> None:
    """The winning fetch-free candidate is laid out from the allocation it was scored
    with (asked once, never rebuilt), bit for bit its ``build``."""
    trace = DriftingTrace(8, 32, 256, 4, sigma=2.0, seed=5)
    c0, c = trace.step(), trace.step()
    prev = moonplan.plan(c0) if with_previous else None
    inp = Inputs(c, 4, 1, None if prev is None else prev.slot_expert,
                 None if prev is None else prev.flow, "torch")  # fmt: skip
    calls: list[str] = []
    p = choose(inp, FREE, tuple(_counted(cand, calls) for cand in TABLE[:2]))
    names = ["static", "resident"] if with_previous else ["static"]
    assert calls == [f"alloc {n}" for n in ("static", "resident")]
    assert p.policy in names and p.planned == 0
    want = build(p.policy, inp)
    for field in ("alloc", "target", "flow", "slot_expert", "slot_new", "row_expert",
                  "row_count", "row_offset"):  # fmt: skip
        assert torch.equal(getattr(p, field), getattr(want, field)), field


def test_the_static_loads_are_read_once_per_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice and every builder share the inputs' static loads (one host read)."""
    from moonplan.plan import choose as choose_mod

    reads: list[int] = []
    real = choose_mod.static_load
    monkeypatch.setattr(choose_mod, "static_load", lambda c: reads.append(1) or real(c))
    inp = _inputs(_skewed())
    p = choose(inp, FREE)
    for name in ("bounded-0.1", "bounded-0.25", "exact"):
        build(name, inp)
    assert reads == [1] and p.planned >= 1
    assert torch.equal(build("bounded-0.1", inp).alloc, moonplan.plan(inp.counts_RE,
                       policy="bounded-0.1").alloc)  # fmt: skip
