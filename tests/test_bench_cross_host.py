"""``bench/bench_cross_host.py``: the routing and allocation experiments against the plan's own
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


def _rows_kept(t: object, alloc_ER: np.ndarray, sent_RE: np.ndarray) -> None:
    """Every record is sent once and received once: the sums of each side agree with the
    counts, up to the rounding up of each rank's rows."""
    R = sent_RE.shape[0]
    sent = t.local_R + t.send_intra_R + t.send_inter_R  # type: ignore[attr-defined]
    recv = t.local_R + t.recv_intra_R + t.recv_inter_R  # type: ignore[attr-defined]
    assert (sent >= sent_RE.sum(1)).all() and (sent <= sent_RE.sum(1) + 3).all()
    assert (recv >= alloc_ER.sum(0)).all() and (recv <= alloc_ER.sum(0) + 3).all()
    assert len(sent) == R


@pytest.mark.parametrize("seed", range(5))
def test_proportional_keeps_what_each_host_can_and_spreads_it(seed: int) -> None:
    """The proportional rule keeps as many rows in each host as domain-first (the least that
    must cross, up to rounding), and a host's rows leave from all of its sources."""
    sent_RE, alloc_ER = _random_case(seed, 8, 6)
    got = bench.proportional(sent_RE, alloc_ER, 4)
    first = bench.domain_first(sent_RE, alloc_ER, 4)
    _rows_kept(got, alloc_ER, sent_RE)
    assert abs(int(got.send_inter_R.sum()) - int(first.send_inter_R.sum())) <= 8
    one_host = bench.proportional(sent_RE, alloc_ER, 8)
    assert not one_host.send_inter_R.any() and not one_host.recv_inter_R.any()


def test_proportional_sends_across_what_a_host_cannot_run() -> None:
    """One expert, two hosts of two ranks: ranks 0 and 1 hold 4 records each and their host
    runs none, rank 2 runs all 8: both sources send their 4 across, rank 2 receives 8."""
    sent_RE, alloc_ER = np.array([[4], [4], [0], [0]]), np.array([[0, 0, 8, 0]])
    got = bench.proportional(sent_RE, alloc_ER, 2)
    assert got.send_inter_R.tolist() == [4, 4, 0, 0] and got.recv_inter_R.tolist() == [0, 0, 8, 0]


def test_proportional_takes_the_kept_rows_from_every_source() -> None:
    """One expert, two hosts of two ranks; sources 0 and 1 (host 0) hold 4 each, executors
    are rank 1 (4 rows) and rank 2 (4 rows). Host 0 keeps 4: domain-first takes them all
    from rank 0 (rank 1 then sends 4 across), proportional 2 from each (each sends 2)."""
    sent_RE, alloc_ER = np.array([[4], [4], [0], [0]]), np.array([[0, 4, 4, 0]])
    first = bench.domain_first(sent_RE, alloc_ER, 2)
    got = bench.proportional(sent_RE, alloc_ER, 2)
    assert first.send_inter_R.tolist() == [0, 4, 0, 0]
    assert got.send_inter_R.tolist() == [2, 2, 0, 0] and got.recv_inter_R.tolist() == [0, 0, 4, 0]


def test_proxy_spreads_a_hosts_arrivals_over_its_ranks() -> None:
    """Two hosts of two ranks, sources 0 and 1 each send 4 records to rank 2: rank 0's go
    straight (rank 2 is its proxy), rank 1's to rank 3, which forwards them over the fast
    link; the interval rule has rank 2 receive all 8 over the slow link."""
    sent_RE, alloc_ER = np.array([[4], [4], [0], [0]]), np.array([[0, 0, 8, 0]])
    got = bench.proxy(sent_RE, alloc_ER, 2)
    assert got.send_inter_R.tolist() == [4, 4, 0, 0] and got.recv_inter_R.tolist() == [0, 0, 4, 4]
    assert got.send_intra_R.tolist() == [0, 0, 0, 4] and got.recv_intra_R.tolist() == [0, 0, 4, 0]
    assert dispatch_traffic(sent_RE, alloc_ER, 2).recv_inter_R.tolist() == [0, 0, 8, 0]


@pytest.mark.parametrize("seed", range(4))
def test_proxy_moves_every_record_and_crosses_as_often_as_the_plan(seed: int) -> None:
    """The same records cross hosts as under the plan's routing (only the receiving rank
    changes); with one host it is the plan's routing."""
    sent_RE, alloc_ER = _random_case(seed, 8, 6)
    got, t = bench.proxy(sent_RE, alloc_ER, 4), dispatch_traffic(sent_RE, alloc_ER, 4)
    assert (got.send_inter_R == t.send_inter_R).all()
    assert got.recv_inter_R.sum() == t.recv_inter_R.sum()
    hops_sent = got.send_intra_R.sum() + got.send_inter_R.sum()
    assert hops_sent == got.recv_intra_R.sum() + got.recv_inter_R.sum()
    assert got.local_R.sum() == t.local_R.sum()
    one = bench.proxy(sent_RE, alloc_ER, 8)
    t8 = dispatch_traffic(sent_RE, alloc_ER, 8)
    assert (one.send_intra_R == t8.send_intra_R).all() and (one.local_R == t8.local_R).all()


def test_aligned_cuts_keep_each_expert_and_move_a_cut_to_the_host_boundary() -> None:
    """One expert, two hosts of two ranks, 2 records on each source; holders rank 1 (5
    rows) and rank 2 (3): the cut at 5 is past host 0's sources (4), so it moves to 4 and
    each holder runs exactly its own host's records."""
    sent_RE, alloc_ER = np.array([[2], [2], [2], [2]]), np.array([[0, 5, 3, 0]])
    got = bench.aligned_cuts(sent_RE, alloc_ER, 2)
    assert got.tolist() == [[0, 4, 4, 0]]
    assert not dispatch_traffic(sent_RE, got, 2).send_inter_R.any()


@pytest.mark.parametrize("seed", range(4))
def test_aligned_cuts_keep_the_totals_and_holders(seed: int) -> None:
    sent_RE, alloc_ER = _random_case(seed, 8, 6)
    got = bench.aligned_cuts(sent_RE, alloc_ER, 4)
    assert (got.sum(1) == alloc_ER.sum(1)).all() and (got >= 0).all()
    assert ((got > 0) <= (alloc_ER > 0)).all()


@pytest.mark.parametrize("seed", range(3))
def test_the_lp_is_below_every_routing_of_the_same_holders(seed: int) -> None:
    """The LP's least busiest slow-link rows is a lower bound: no routing of the plan's own
    allocation (interval, domain-first, proportional) has a rank with fewer."""
    pytest.importorskip("scipy", reason="the LP column needs scipy (optional for this bench)")
    sent_RE, alloc_ER = _random_case(seed, 8, 6)
    least = bench.least_busiest(sent_RE, alloc_ER, 4)
    assert least is not None
    for t in (dispatch_traffic(sent_RE, alloc_ER, 4), bench.domain_first(sent_RE, alloc_ER, 4)):
        assert least <= np.maximum(t.send_inter_R, t.recv_inter_R).max() + 1e-6
    assert bench.least_busiest(sent_RE, alloc_ER, 8) == pytest.approx(0.0, abs=1e-9)


def test_without_scipy_the_lp_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """No scipy: the LP returns None (the column reads ``-``), it does not guess."""
    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    sent_RE, alloc_ER = _random_case(0, 4, 3)
    assert bench.least_busiest(sent_RE, alloc_ER, 2) is None


@pytest.mark.slow
def test_a_short_run_reports_both_routings() -> None:
    out = bench.run_point((*bench.POINTS[0][:2], 16, 2.0, 16), steps=2)
    assert out["resident_steps"] <= 2
    assert all(set(out[v]) == set(out["interval"]) for v in bench.VARIANTS)
