"""Dispatch rows by link under the record, rank and host schemes (``scheme_traffic``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moonplan.stepcost import StepCost
from moonplan.stepcost.traffic import (
    SCHEMES,
    Traffic,
    dispatch_traffic,
    rows_per_record,
    scheme_traffic,
)

FIELDS = ("local_R", "send_intra_R", "send_inter_R", "recv_intra_R", "recv_inter_R")


def reference(dest: np.ndarray, scheme: str, G: int) -> dict[str, list[int]]:
    """Plain-Python rows per rank and link: one hop at a time."""
    R = dest.shape[0]
    out = {f: [0] * R for f in FIELDS}

    def hop(a: int, b: int) -> None:
        if a == b:
            out["local_R"][a] += 1
        elif a // G == b // G:
            out["send_intra_R"][a] += 1
            out["recv_intra_R"][b] += 1
        else:
            out["send_inter_R"][a] += 1
            out["recv_inter_R"][b] += 1

    for s in range(R):
        for row in dest[s].tolist():
            ds = [d for d in row if d >= 0]
            if scheme == "record":
                for d in ds:
                    hop(s, d)
                continue
            if scheme == "rank":
                for d in sorted(set(ds)):
                    hop(s, d)
                continue
            for d in sorted({d for d in ds if d // G == s // G}):
                hop(s, d)
            for h in sorted({d // G for d in ds if d // G != s // G}):
                peer = h * G + (s % G) % min(G, R - h * G)
                hop(s, peer)
                for d in sorted({d for d in ds if d // G == h}):
                    hop(peer, d)
    return out


def as_lists(t: Traffic) -> dict[str, list[int]]:
    return {f: getattr(t, f).tolist() for f in FIELDS}


@given(
    R=st.integers(1, 9),
    S=st.integers(0, 6),
    K=st.integers(1, 5),
    G=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    scheme=st.sampled_from(SCHEMES),
)
def test_scheme_traffic_equals_reference(
    R: int, S: int, K: int, G: int, seed: int, scheme: str
) -> None:
    dest = np.random.default_rng(seed).integers(-1, R, size=(R, S, K))
    assert as_lists(scheme_traffic(dest, scheme, G)) == reference(dest, scheme, G)


def _random_dest(seed: int, R: int = 16, S: int = 200, K: int = 8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, R, size=(R, S, K))


@pytest.mark.parametrize("seed", range(4))
def test_host_sends_no_more_over_the_network_than_rank(seed: int) -> None:
    dest, G = _random_dest(seed), 4
    rank, host, rec = (scheme_traffic(dest, s, G) for s in ("rank", "host", "record"))
    assert host.send_inter_R.sum() <= rank.send_inter_R.sum() <= rec.send_inter_R.sum()
    assert host.send_inter_R.sum() < rank.send_inter_R.sum()  # K=8 over 4 hosts: repeats
    # what host saves on the network it forwards over the fast links
    assert host.send_intra_R.sum() >= rank.send_intra_R.sum()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_rows_are_conserved(scheme: str) -> None:
    dest, G = _random_dest(7), 4
    dest[0, :5] = -1  # dropped records send nothing
    t = scheme_traffic(dest, scheme, G)
    assert t.send_intra_R.sum() == t.recv_intra_R.sum()
    assert t.send_inter_R.sum() == t.recv_inter_R.sum()
    # every (token, destination) row reaches its destination exactly once
    R = dest.shape[0]
    pairs = {(s, tok, d) for s in range(R) for tok in range(dest.shape[1]) for d in dest[s, tok]}
    unique = sum(1 for p in pairs if p[2] >= 0)
    records = int((dest >= 0).sum())
    arrived = t.local_R.sum() + t.recv_intra_R.sum() + t.recv_inter_R.sum()
    if scheme == "record":
        assert arrived == records
    elif scheme == "rank":
        assert arrived == unique
    else:  # each network row arrives at the NIC peer, which hands it to every
        # destination of its host (over the fast links, or locally when it is one)
        far = {(s, tok, d // G) for s, tok, d in pairs if d >= 0 and d // G != s // G}
        assert arrived == unique + len(far)
        assert t.send_inter_R.sum() == len(far)


def test_record_scheme_of_the_routing_rule_is_dispatch_traffic() -> None:
    # expert e on rank e (E = R = 4), every token picks experts (0, 1, 3): rows by counts
    R, S = 4, 3
    dest = np.tile(np.array([0, 1, 3]), (R, S, 1))
    sent = np.zeros((R, R), dtype=np.int64)
    sent[:, [0, 1, 3]] = S
    rows = np.diag(sent.sum(0))
    assert as_lists(scheme_traffic(dest, "record", 2)) == as_lists(dispatch_traffic(sent, rows, 2))


def test_rows_per_record() -> None:
    # 4 ranks, hosts of 2; ranks 0 and 1 (host 0) route one token each, 2 and 3 none
    dest = np.array([[[0, 0, 1, 3]], [[2, 3, 3, 3]]])
    dest = np.concatenate([dest, np.full((2, 1, 4), -1)])
    assert rows_per_record(dest, "record", 2) == 1.0
    assert rows_per_record(dest, "rank", 2) == pytest.approx(5 / 8)  # {0, 1, 3} and {2, 3}
    # host: rank 0 sends rows to 0 and 1 (its host) and one to host 1; rank 1 one to host 1
    assert rows_per_record(dest, "host", 2) == pytest.approx(4 / 8)
    assert rows_per_record(np.full((1, 1, 1), -1), "rank", 1) == 0.0


def test_step_cost_record_unchanged_and_scheme_needs_traffic() -> None:
    c = StepCost.from_hardware("h200-multinode", "deepseek-v3")
    assert c.dispatch == "record"
    rng = np.random.default_rng(0)
    R, E = 16, 32
    sent = rng.integers(0, 50, size=(R, E))
    rows = np.zeros((E, R), dtype=np.int64)
    rows[np.arange(E), np.arange(E) // 2] = sent.sum(0)
    fetch, src = np.zeros((E, R), dtype=bool), np.arange(E) // 2
    base = c.step_time(rows, sent, fetch, src)
    same = c.step_time(rows, sent, fetch, src, traffic=dispatch_traffic(sent, rows, 8))
    assert base == same
    rank = c.scaled(dispatch="rank")
    with pytest.raises(ValueError, match="traffic"):
        rank.step_time(rows, sent, fetch, src)
    with pytest.raises(ValueError, match="dispatch"):
        c.scaled(dispatch="token")
    # half the rows on every link: dispatch and combine link time halve
    half = Traffic(*(getattr(dispatch_traffic(sent, rows, 8), f) // 2 for f in FIELDS))
    t = rank.step_time(rows, sent, fetch, src, traffic=half)
    fixed = c.base_latency_s + c.per_peer_latency_s * (R - 1)
    assert t.dispatch_s - fixed == pytest.approx((base.dispatch_s - fixed) / 2, rel=0.05)
    assert t.experts_s == base.experts_s and t.total_s < base.total_s
