"""``bench/bench_cross_host.py``: the domain-first routing experiment against the plan's own
interval routing, on hand cases and random allocations, and one short run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_cross_host as bench

from moonplan.stepcost import dispatch_traffic


def _random_case(seed: int, R: int, E: int) -> tuple[np.ndarray, np.ndarray]:
    """``sent_RE`` and an ``alloc_ER`` with the same expert totals, spread at random."""
    rng = np.random.default_rng(seed)
    sent_RE = rng.integers(0, 20, size=(R, E))
    alloc_ER = np.zeros((E, R), dtype=np.int64)
    for e, total in enumerate(sent_RE.sum(0)):
        alloc_ER[e] = rng.multinomial(total, rng.dirichlet(np.ones(R)))
    return sent_RE, alloc_ER


def test_interval_pairs_match_position_by_position() -> None:
    assert bench.interval_pairs([3, 0, 2], [1, 4]) == [(0, 0, 1), (0, 1, 2), (2, 1, 2)]


@pytest.mark.parametrize("seed", range(5))
def test_one_host_routes_as_the_plan_does(seed: int) -> None:
    """With every rank on one host the two routings are the same rule."""
    sent_RE, alloc_ER = _random_case(seed, 6, 5)
    got = bench.domain_first(sent_RE, alloc_ER, 6)
    t = dispatch_traffic(sent_RE, alloc_ER, 6)
    assert (got.send_intra_R == t.send_intra_R).all() and (got.recv_intra_R == t.recv_intra_R).all()
    assert (got.local_R == t.local_R).all()
    assert not got.send_inter_R.any() and not got.recv_inter_R.any()


@pytest.mark.parametrize("seed", range(5))
def test_domain_first_never_sends_more_across_hosts(seed: int) -> None:
    """Each host keeps what it can: no more rows cross hosts than the least that must (the
    sum over experts and hosts of sources beyond the host's executors), and the interval
    rule never sends fewer."""
    sent_RE, alloc_ER = _random_case(seed, 8, 6)
    got = bench.domain_first(sent_RE, alloc_ER, 4)
    t = dispatch_traffic(sent_RE, alloc_ER, 4)
    s_EH = sent_RE.T.reshape(6, 2, 4).sum(2)
    a_EH = alloc_ER.reshape(6, 2, 4).sum(2)
    least = int(np.maximum(0, s_EH - a_EH).sum())
    assert got.send_inter_R.sum() == got.recv_inter_R.sum() == least <= t.send_inter_R.sum()


def test_a_host_keeps_its_own_sources_rows() -> None:
    """One expert, three hosts of one rank, sources on ranks 0 and 1, executors 1 and 2:
    the interval rule sends both sources' rows across (0 -> 1, 1 -> 2), domain-first keeps
    rank 1's at home and sends only rank 0's (0 -> 2)."""
    sent_RE, alloc_ER = np.array([[5], [5], [0]]), np.array([[0, 5, 5]])
    t = dispatch_traffic(sent_RE, alloc_ER, 1)
    got = bench.domain_first(sent_RE, alloc_ER, 1)
    assert t.send_inter_R.tolist() == [5, 5, 0]
    assert got.send_inter_R.tolist() == [5, 0, 0] and got.recv_inter_R.tolist() == [0, 0, 5]


@pytest.mark.slow
def test_a_short_run_reports_both_routings() -> None:
    out = bench.run_point((*bench.POINTS[0][:2], 16, 2.0, 16), steps=2)
    assert out["resident_steps"] <= 2 and set(out["interval"]) == set(out["domain_first"])
