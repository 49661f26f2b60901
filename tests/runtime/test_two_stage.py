"""The two-stage transport (``a2a-hosts``): exact data path, gradients, traffic by stage.

Legend: R ranks, G ranks per host, S tokens, K top-k, H hidden, E experts.

Hosts are simulated on one machine: ``LOCAL_WORLD_SIZE`` (or ``ranks_per_host``) groups
consecutive gloo ranks. 4 ranks run as 2 hosts of 2, 1 host of 4 and 4 hosts of 1.
"""

from __future__ import annotations

import os

import pytest
import torch

import moonplan
from moonplan.runtime.transports.two_stage import TwoStageTokenTransport, ranks_per_host_of
from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_moe, dense_weights, tokens
from tests.runtime.test_layer import _hot_ids, _layer_outputs
from tests.runtime.test_training import _rank_grads, _reference
from tests.runtime.test_transports import _round_trip, _tokens

pytestmark = pytest.mark.distributed

TIMEOUT = 120
HOSTS = [2, 4, 1]  # ranks per host on 4 ranks: 2 x 2, one host, four hosts
BF16_TOL = {"rtol": 4e-2, "atol": 4e-2}  # per-record sums round once, two-stage up to 3x


def _with_env(rank: int, world: int, env: dict[str, str], fn, *args):
    os.environ.update(env)  # this forked rank process only
    return fn(rank, world, *args)


@pytest.mark.parametrize("G", HOSTS)
def test_round_trip_on_four_ranks_matches_reference(G: int) -> None:
    """The shared transport check (every operation against the plain reference)."""
    got = run_ranks(_round_trip, 4, "a2a-hosts", {"LOCAL_WORLD_SIZE": str(G)}, timeout=TIMEOUT)
    assert [g["fails"] for g in got] == [[]] * 4


@pytest.mark.parametrize(
    ("G", "E", "K", "sizes"),
    [
        (2, 10, 8, [5, 0, 6, 4]),
        (4, 9, 8, [4, 6, 3, 0]),
        (1, 12, 4, [0, 6, 5, 7]),
        (2, 3, 2, [6, 5, 4, 7]),
    ],
)
def test_layer_gradients_equal_dense_reference(G: int, E: int, K: int, sizes: list[int]) -> None:
    """Gradients (x, router, expert weights) equal the fp64 dense layer; top-8, an empty
    rank, E < R."""
    cfg = {"H": 8, "F": 12, "E": E, "K": K, "seed": 11, "sizes": sizes, "slots": None}
    cfg.update(align=1, transport="a2a-hosts", env={"LOCAL_WORLD_SIZE": str(G)})
    got = run_ranks(_rank_grads, 4, cfg, timeout=TIMEOUT)
    want = _reference(cfg)
    for r, g in enumerate(got):
        for name in ("x", "router"):
            torch.testing.assert_close(g[name].double(), want[name][r], rtol=1e-5, atol=1e-6)
        for name in ("gate_up", "down"):
            torch.testing.assert_close(
                g[name].double(), want[name][g["home"]], rtol=1e-5, atol=1e-6
            )


@pytest.mark.parametrize("G", HOSTS)
def test_layer_outputs_equal_dense_oracle(G: int) -> None:
    """Two steps (the second with resident slots) of a skewed top-8 layer with an empty
    rank equal the dense oracle; the second step gives the same bits."""
    H, F, E, K, sizes = 16, 24, 10, 8, [7, 0, 9, 5]
    cfg = {"H": H, "F": F, "E": E, "K": K, "seed": 4, "sizes": sizes, "steps": 2}
    cfg["ids"], cfg["w"] = _hot_ids(sum(sizes), E, K, 4)
    cfg["transport"] = "a2a-hosts"
    env = {"LOCAL_WORLD_SIZE": str(G)}
    outs = run_ranks(_with_env, 4, env, _layer_outputs, cfg, timeout=TIMEOUT)
    want = dense_moe(tokens(sum(sizes), H, 4), cfg["ids"], cfg["w"], dense_weights(E, H, F, 4))
    got = torch.cat([o[0] for o in outs if o.numel()])
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(o[0], o[1]) for o in outs if o.numel())


def _layer_steps(rank: int, world: int, cfg: dict) -> dict:
    """Outputs and input gradients of ``a2a-hosts`` (twice) and ``a2a-records``."""
    from moonplan import MoonMoE
    from tests.runtime.oracle import split

    H, F, E, K, dtype = 16, 24, cfg["E"], cfg["K"], cfg["dtype"]
    w = dense_weights(E, H, F, seed=5)
    x = split(tokens(sum(cfg["sizes"]), H, 5), cfg["sizes"])[rank].to(dtype)
    out = {}
    for name in ("a2a-hosts", "a2a-records"):
        layer = MoonMoE(H, F, E, K, transport=name, dtype=dtype)
        layer.load_dense(*(w[k].to(dtype) for k in ("router_weight", "gate_up", "down")))
        for run in range(2):
            x_r = x.clone().requires_grad_(True)
            y = layer(x_r)
            y.float().square().sum().backward()
            out[f"{name}{run}"] = (y.detach(), x_r.grad)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_reruns_bit_identical_and_close_to_per_record(dtype: torch.dtype) -> None:
    """Two runs give the same bits; the per-record a2a layer agrees (bf16: tolerance)."""
    cfg = {"E": 9, "K": 8, "sizes": [6, 0, 5, 7], "dtype": dtype}
    got = run_ranks(_with_env, 4, {"LOCAL_WORLD_SIZE": "2"}, _layer_steps, cfg, timeout=TIMEOUT)
    tol = BF16_TOL if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    for g in got:
        for a, b in zip(g["a2a-hosts0"], g["a2a-hosts1"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(g["a2a-hosts0"], g["a2a-records0"], strict=True):
            torch.testing.assert_close(a.float(), b.float(), **tol)


def _step(t, plan, route, x, w, dy, dx_PH=None) -> tuple[list[torch.Tensor], dict]:
    """Forward and backward of one step with row-wise experts; every result, traffic."""
    view = t.dispatch(x, route, plan, weight_SK=w)
    recv = view.tensor.clone()
    y = t.combine(recv.tanh(), route, w, view.state)
    g, dw = t.combine_backward(dy, route, plan, w, view.state)
    dx = t.dispatch_backward(recv.square() if dx_PH is None else dx_PH, route, view.state)
    return [recv, y, g.clone(), dw, dx], view.state.traffic


def _two_forwards(rank: int, world: int, G: int) -> list[str]:
    """Step A's forward, step B's forward, B's backward, A's backward: the same bits as
    each step alone, and as a rerun."""
    from moonplan.comm.group import EPGroup

    t = TwoStageTokenTransport(EPGroup(), 256, 6, torch.float32, ranks_per_host=G)
    ids_R = [_tokens(q, torch.float32)[0] for q in range(world)]
    counts = torch.stack([torch.bincount(i.view(-1), minlength=5) for i in ids_R])
    plan = moonplan.plan(counts, align=2)
    ids, x, w = _tokens(rank, torch.float32)
    route = moonplan.route(plan, rank, ids, affinity=True)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank))
    a = _step(t, plan, route, x, w, dy)[0]
    b = _step(t, plan, route, 2 * x + 1, w.flip(-1), -dy)[0]
    fails = [] if all(map(torch.equal, a, _step(t, plan, route, x, w, dy)[0])) else ["rerun"]
    va = t.dispatch(x, route, plan, weight_SK=w)
    ra = va.tensor.clone()
    ya = t.combine(ra.tanh(), route, w, va.state)
    vb = t.dispatch(2 * x + 1, route, plan, weight_SK=w.flip(-1))
    rb = vb.tensor.clone()
    yb = t.combine(rb.tanh(), route, w.flip(-1), vb.state)
    gb, dwb = t.combine_backward(-dy, route, plan, w.flip(-1), vb.state)
    gb = gb.clone()
    dxb = t.dispatch_backward(rb.square(), route, vb.state)
    ga, dwa = t.combine_backward(dy, route, plan, w, va.state)
    dxa = t.dispatch_backward(ra.square(), route, va.state)
    for name, got, want in (("A", [ra, ya, ga, dwa, dxa], a), ("B", [rb, yb, gb, dwb, dxb], b)):
        if not all(map(torch.equal, got, want)):
            fails.append(name)
    return fails


@pytest.mark.parametrize("G", [2, 1])
def test_two_forwards_before_their_backwards(G: int) -> None:
    assert run_ranks(_two_forwards, 4, G, timeout=TIMEOUT) == [[]] * 4


def _traffic(rank: int, world: int, G: int, K: int) -> dict:
    """This rank's ``StepState.traffic``, and the same figures counted from the routes."""
    from moonplan.comm.group import EPGroup

    H = 6
    t = TwoStageTokenTransport(EPGroup(), 512, H, torch.bfloat16, ranks_per_host=G)
    g = torch.Generator().manual_seed(3)
    sizes = [9, 0, 7, 12]
    ids_R = [torch.stack([torch.randperm(10, generator=g)[:K] for _ in range(n)]) if n
             else torch.zeros(0, K, dtype=torch.int64) for n in sizes]  # fmt: skip
    counts = torch.stack([torch.bincount(i.view(-1), minlength=10) for i in ids_R])
    plan = moonplan.plan(counts)
    routes = [moonplan.route(plan, q, ids_R[q], affinity=True) for q in range(world)]
    x = torch.randn(sizes[rank], H).bfloat16()
    w = torch.rand(sizes[rank], K)
    P = int(plan.recv_size()[rank])
    from moonplan.runtime.transports import two_stage

    calls = []  # pair_records of the step: the stage rooms and the traffic share one
    real = two_stage.pair_records
    two_stage.pair_records = lambda p: calls.append(p) or real(p)  # this rank process only
    traffic = _step(t, plan, routes[rank], x, w, x, torch.zeros(P, H).bfloat16())[1]
    return {"traffic": dict(traffic), "want": _from_routes(routes, rank, G, row=H * 2),
            "pair_records": len(calls)}  # fmt: skip


def _from_routes(routes, me: int, G: int, row: int) -> dict:
    """What rank ``me`` sends in dispatch and combine, counted in Python from every
    rank's route (``moonplan/runtime/transports/two_stage.py`` documents the bytes)."""
    host = me // G
    pairs = [{(s, d) for s, r in enumerate(rt.dest_rank.tolist()) for d in r} for rt in routes]
    mine = pairs[me]
    out_hosts = {(s, d // G) for s, d in mine}  # stage 1, self included
    inter = {(s, h) for s, h in out_hosts if h != host}
    records = routes[me].dest_rank.reshape(-1).tolist()
    # As proxy: (source, token, destination) of the sources with my local index.
    peers = [q for q in range(len(routes)) if q % G == me % G]
    fwd = {(q, s, d) for q in peers for s, d in pairs[q] if d // G == host}
    intra = {(q, s, d) for q, s, d in fwd if d != me}
    staged = {(q, s) for q, s, _ in fwd}  # combine: back to the sources
    executed = {(q, s) for q, p in enumerate(pairs) for s, d in p if d == me}  # to the proxies
    inter_bytes = row * (len(inter) + sum(1 for q, _ in staged if q // G != host))
    inter_bytes += 24 * sum(1 for _, d in mine if d // G != host)
    inter_bytes += 8 * sum(1 for d in records if d // G != host)
    intra_bytes = row * (len(intra) + sum(1 for q, _ in executed if q % G != me % G))
    intra_bytes += 8 * sum(1 for d in records if d // G == host and d != me)
    sent = row * (len(out_hosts) + len(fwd) + len(staged) + len(executed))
    sent += 24 * len(mine) + 8 * len(records)
    return {
        "records": len(records),
        "rows_sent": len(out_hosts) + len(fwd),
        "rows_inter": len(inter),
        "rows_intra": len(intra),
        "bytes_inter": inter_bytes,
        "bytes_intra": intra_bytes,
        "bytes_sent": sent,
    }


@pytest.mark.parametrize(("G", "K"), [(2, 8), (2, 3), (4, 8), (1, 8)])
def test_traffic_counts_distinct_token_host_pairs(G: int, K: int) -> None:
    """Rows crossing hosts are the distinct (token, other host) pairs; rows forwarded
    inside a host the distinct (token, other rank of the host) pairs its proxy serves;
    bytes are rows times row bytes plus the documented metadata."""
    got = run_ranks(_traffic, 4, G, K, timeout=TIMEOUT)
    for g in got:
        t, want = g["traffic"], g["want"]
        assert {k: t[k] for k in want} == want
        assert g["pair_records"] == 1  # once a step
    rows = [sum(g["traffic"][k] for g in got) for k in ("rows_inter", "rows_intra")]
    if G == 4:
        assert rows[0] == 0  # one host: nothing crosses
    if G == 1:
        assert rows[1] == 0  # hosts of one rank: nothing to forward
    if G == 2:
        assert min(rows) > 0


def test_ranks_per_host_must_divide_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ranks_per_host_of(4, None) == 4  # unset: one host
    assert ranks_per_host_of(4, 2) == 2 and ranks_per_host_of(4, 1) == 1
    with pytest.raises(ValueError, match="ranks_per_host must divide the 4 ranks, got 3"):
        ranks_per_host_of(4, 3)
    with pytest.raises(ValueError, match="ranks_per_host must divide the 4 ranks, got 0"):
        ranks_per_host_of(4, 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks_per_host_of(4, None) == 2 and ranks_per_host_of(4, 4) == 4  # the keyword wins
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must divide the 4 ranks, got 3"):
        ranks_per_host_of(4, None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be an integer, got 'two'"):
        ranks_per_host_of(4, None)


@pytest.mark.slow  # Triton interpreter on 2 ranks (2.5-6 s)
def test_triton_token_ops_give_the_reference_bits() -> None:
    """With the Triton row ops (interpreted on CPU) the round trip still matches the
    reference (``_round_trip`` checks the backend it ran)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    env = {"MOONPLAN_ROW_OPS": "triton", "TRITON_INTERPRET": "1", "LOCAL_WORLD_SIZE": "2"}
    got = run_ranks(_round_trip, 4, "a2a-hosts", env, timeout=TIMEOUT)
    assert [g["fails"] for g in got] == [[]] * 4


def _layer_traffic(rank: int, world: int) -> dict:
    """A top-8 ``a2a-hosts`` layer's ``last_stats``, and the figures from the routes."""
    from moonplan import MoonMoE
    from tests.runtime.test_layer import _fixed_router

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # this forked rank process only
    H, E, K, S = 8, 16, 8, 12
    ids, wk = _hot_ids(S * world, E, K, seed=5)
    layer = MoonMoE(H, 12, E, K, router=_fixed_router(ids, wk, S * rank), transport="a2a-hosts")
    layer(tokens(S * world, H, 5)[S * rank : S * (rank + 1)])
    stats, plan = layer.last_stats, layer.runtime.last_plan
    assert stats is not None and plan is not None
    ids_R = ids.split(S)
    routes = [moonplan.route(plan, q, ids_R[q], affinity=True) for q in range(world)]
    return {
        "stats": (stats.records, stats.rows_sent, stats.bytes_sent),
        "want": _from_routes(routes, rank, 2, row=H * 4),
    }


def test_layer_last_stats_count_both_stages() -> None:
    """``layer.last_stats`` of ``a2a-hosts``: the rows this rank sent in both stages and
    the bytes of dispatch and combine, as counted from the routes."""
    for got in run_ranks(_layer_traffic, 4, timeout=TIMEOUT):
        want = got["want"]
        assert got["stats"] == (want["records"], want["rows_sent"], want["bytes_sent"])
