"""Records' destinations of every policy and the simulator's dispatch schemes."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import moonplan
from moonplan.baselines import make_policy
from moonplan.plan.route import route
from moonplan.simulate.dispatch_rows import line_dest, step_dest, step_traffic
from moonplan.simulate.model_time import SimConfig, step_time
from moonplan.simulate.models import get_model
from moonplan.simulate.sweep import simulate_trace
from moonplan.simulate.token_routing import drifting_tokens, token_counts, token_trace
from moonplan.simulate.workload import drifting_popularity
from moonplan.stepcost.hardware import get_hardware
from moonplan.stepcost.traffic import dispatch_traffic, rows_per_record, scheme_traffic

FIELDS = ("local_R", "send_intra_R", "send_inter_R", "recv_intra_R", "recv_inter_R")


def _ids(R: int, E: int, S: int, K: int, sigma: float, seed: int) -> torch.Tensor:
    pop = next(drifting_popularity(E, sigma=sigma, steps=1, seed=seed))
    return next(drifting_tokens([pop], R, S, K, seed=seed)).long()


def _same(a: object, b: object) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


@pytest.mark.parametrize("seed", range(3))
def test_line_dest_is_plain_route(seed: int) -> None:
    ids = _ids(4, 12, 40, 3, 1.5, seed)
    counts = token_counts(ids, 12)
    plan = moonplan.plan(counts, backend="torch")
    dest = line_dest(ids, plan.alloc, counts)
    assert np.array_equal(dest, line_dest(ids, plan.alloc, counts, counts))  # counted already
    for s in range(4):
        plain = route(plan, s, ids[s], affinity=False).dest_rank
        assert np.array_equal(dest[s], plain.numpy())


@pytest.mark.parametrize("name", ["static-linear", "eplb", "moonplan", "capacity-1.0"])
def test_record_scheme_of_every_policy_is_dispatch_traffic(name: str) -> None:
    ids = _ids(8, 16, 64, 4, 1.0, 1)
    step = make_policy(name, 8, 16, nodes=2, period=1, window=1).step(token_counts(ids, 16))
    dest = step_dest(step, ids, affinity=False)
    assert int((dest < 0).sum()) == step.dropped
    got = step_traffic(step, ids, "record", 4, dest)
    assert _same(got, dispatch_traffic(step.sent_RE, step.rows_ER, 4))


def test_affinity_keeps_counts_and_never_sends_more_rows() -> None:
    ids = _ids(8, 16, 256, 4, 1.5, 2)
    step = make_policy("moonplan", 8, 16).step(token_counts(ids, 16))
    plain, aff = step_dest(step, ids, affinity=False), step_dest(step, ids, affinity=True)
    assert not np.array_equal(plain, aff)  # some split expert's records moved
    for s in range(8):  # per (source, destination, expert) counts unchanged
        for d in range(8):
            a = np.bincount(ids[s].numpy()[aff[s] == d], minlength=16)
            p = np.bincount(ids[s].numpy()[plain[s] == d], minlength=16)
            assert np.array_equal(a, p)
    assert rows_per_record(aff, "rank", 8) < rows_per_record(plain, "rank", 8)


def test_capacity_padding_rows_are_sent_under_every_scheme() -> None:
    ids = _ids(4, 8, 64, 2, 1.0, 3)
    step = make_policy("capacity-1.25", 4, 8).step(token_counts(ids, 8))
    dest = step_dest(step, ids, affinity=False)
    pad = int((step.sent_RE - torch.minimum(token_counts(ids, 8), step.sent_RE)).sum())
    assert pad > 0
    for scheme in ("rank", "host"):
        t = step_traffic(step, ids, scheme, 2, dest)
        rows = scheme_traffic(dest, scheme, 2)
        assert t.send_inter_R.sum() + t.send_intra_R.sum() + t.local_R.sum() == (
            rows.send_inter_R.sum() + rows.send_intra_R.sum() + rows.local_R.sum() + pad
        )


def test_step_time_schemes() -> None:
    model, hw = get_model("deepseek-v3"), get_hardware("h200-multinode")
    counts, ids = token_trace(model, 16, 128, drifting_popularity(256, sigma=1.0, steps=1))
    step = make_policy("moonplan", 16, 256).step(counts[0])
    rec = step_time(step, model, hw, SimConfig())
    assert rec == step_time(step, model, hw, SimConfig(), ids[0])  # ids unused by "record"
    with pytest.raises(ValueError, match="topk_ids"):
        step_time(step, model, hw, SimConfig(dispatch="rank"))
    rank = step_time(step, model, hw, SimConfig(dispatch="rank"), ids[0])
    host = step_time(step, model, hw, SimConfig(dispatch="host"), ids[0])
    assert host.dispatch_s <= rank.dispatch_s < rec.dispatch_s
    assert rank.experts_s == rec.experts_s and rank.combine_s < rec.combine_s


def test_simulate_trace_with_tokens_applies_the_scheme_to_every_policy() -> None:
    model, hw = get_model("deepseek-v3"), get_hardware("h200-multinode")
    counts, ids = token_trace(model, 16, 64, drifting_popularity(256, sigma=1.0, steps=2), 1)
    names = ["static-linear", "eplb", "moonplan-resident"]
    rec = simulate_trace(counts, model, hw, SimConfig(), names, warmup=1)
    rank = simulate_trace(
        counts, model, hw, SimConfig(dispatch="rank"), names, warmup=1, topk_ids=ids
    )
    for a, b in zip(rec, rank, strict=True):
        assert b["dispatch_us"] < a["dispatch_us"] and b["experts_us"] == a["experts_us"]


@pytest.mark.parametrize("name", ["moonplan", "capacity-1.25", "static-linear"])
def test_scheme_step_traffic_counts_the_tokens_once(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One count of the step's tokens serves the routing and the padding: the same rows
    as each part counting on its own."""
    from moonplan.simulate import dispatch_rows

    ids = _ids(4, 8, 64, 2, 1.5, 4)
    step = make_policy(name, 4, 8).step(token_counts(ids, 8))
    aff = name in dispatch_rows.AFFINITY_POLICIES
    want = step_traffic(step, ids, "rank", 2, step_dest(step, ids, aff))
    calls: list[int] = []
    real = dispatch_rows.token_counts
    monkeypatch.setattr(dispatch_rows, "token_counts", lambda i, e: calls.append(e) or real(i, e))
    got = dispatch_rows.scheme_step_traffic(step, ids, "rank", 2)
    assert calls == [8] and _same(got, want)


def test_simulate_trace_routes_with_the_counts_it_was_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trace's counts serve every policy's routing: no step is recounted, and the
    rows are those of recounting every step for every policy."""
    from moonplan.simulate import dispatch_rows

    sweep = sys.modules["moonplan.simulate.sweep"]  # the package's ``sweep`` is a function
    model, hw = get_model("deepseek-v3"), get_hardware("h200-multinode")
    counts, ids = token_trace(model, 8, 64, drifting_popularity(256, sigma=1.0, steps=3), 2)
    names, cfg = ["static-linear", "capacity-1.25", "moonplan-resident"], SimConfig(dispatch="rank")
    with monkeypatch.context() as m:  # the recounting reference: counts_RE dropped
        real_time = sweep.step_time
        m.setattr(sweep, "step_time", lambda *a, counts_RE, **k: real_time(*a, **k))
        want = simulate_trace(counts, model, hw, cfg, names, warmup=1, topk_ids=ids)
    calls: list[int] = []
    real = dispatch_rows.token_counts
    monkeypatch.setattr(dispatch_rows, "token_counts", lambda i, e: calls.append(e) or real(i, e))
    assert simulate_trace(counts, model, hw, cfg, names, warmup=1, topk_ids=ids) == want
    assert calls == []
    monkeypatch.setattr(sweep, "step_time", lambda *a, counts_RE, **k: real_time(*a, **k))
    simulate_trace(counts, model, hw, cfg, names, warmup=1, topk_ids=ids)
    assert calls == [256] * 6  # the reference counts 2 measured steps x 3 policies


def test_simulate_trace_refuses_ids_that_do_not_match_the_counts() -> None:
    model, hw = get_model("deepseek-v3"), get_hardware("h200-multinode")
    counts, ids = token_trace(model, 8, 64, drifting_popularity(256, sigma=1.0, steps=2), 2)
    cfg = SimConfig(dispatch="rank")
    with pytest.raises(ValueError, match="topk_ids has 1 steps"):
        simulate_trace(counts, model, hw, cfg, ["static-linear"], topk_ids=ids[:1])
    with pytest.raises(ValueError, match="step 1: topk_ids"):
        simulate_trace(counts, model, hw, cfg, ["static-linear"], topk_ids=[ids[0], ids[1][:, :32]])
