"""The two-stage transport (``a2a-hosts``): exact data path, gradients, traffic by stage.

Legend: R ranks, L ranks per host, S tokens, K top-k, H hidden, E experts, T all tokens.

Hosts are simulated on one machine: ``LOCAL_WORLD_SIZE`` (or ``ranks_per_host``) groups
consecutive gloo ranks. 4 ranks run as 2 hosts of 2, 1 host of 4 and 4 hosts of 1.
"""

from __future__ import annotations

import os

import pytest
import torch

import moonplan
from moonplan.runtime.transports.two_stage import TwoStageTransport, hosts_of
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


@pytest.mark.parametrize("L", HOSTS)
def test_round_trip_on_four_ranks_matches_reference(L: int) -> None:
    """The shared transport check (every operation against the plain reference)."""
    got = run_ranks(_round_trip, 4, "a2a-hosts", {"LOCAL_WORLD_SIZE": str(L)}, timeout=TIMEOUT)
    assert [g["fails"] for g in got] == [[]] * 4


@pytest.mark.parametrize(
    ("L", "E", "K", "sizes"),
    [
        (2, 10, 8, [5, 0, 6, 4]),
        (4, 9, 8, [4, 6, 3, 0]),
        (1, 12, 4, [0, 6, 5, 7]),
        (2, 3, 2, [6, 5, 4, 7]),
    ],
)
def test_layer_gradients_equal_dense_reference(L: int, E: int, K: int, sizes: list[int]) -> None:
    """Outputs' gradients (x, router, expert weights) equal the fp64 dense layer; top-8,
    an empty rank, E < R."""
    cfg = {"H": 8, "F": 12, "E": E, "K": K, "seed": 11, "sizes": sizes, "slots": None}
    cfg.update(align=1, transport="a2a-hosts")
    got = run_ranks(_with_env, 4, {"LOCAL_WORLD_SIZE": str(L)}, _rank_grads, cfg, timeout=TIMEOUT)
    want = _reference(cfg)
    for r, g in enumerate(got):
        for name in ("x", "router"):
            torch.testing.assert_close(g[name].double(), want[name][r], rtol=1e-5, atol=1e-6)
        for name in ("gate_up", "down"):
            torch.testing.assert_close(
                g[name].double(), want[name][g["home"]], rtol=1e-5, atol=1e-6
            )


@pytest.mark.parametrize("L", HOSTS)
def test_layer_outputs_equal_dense_oracle(L: int) -> None:
    """Two steps (the second with resident slots) of a skewed top-8 layer with an empty
    rank equal the dense oracle; the second step gives the same bits."""
    H, F, E, K, sizes = 16, 24, 10, 8, [7, 0, 9, 5]
    cfg = {"H": H, "F": F, "E": E, "K": K, "seed": 4, "sizes": sizes, "steps": 2}
    cfg["ids"], cfg["w"] = _hot_ids(sum(sizes), E, K, 4)
    cfg["transport"] = "a2a-hosts"
    env = {"LOCAL_WORLD_SIZE": str(L)}
    outs = run_ranks(_with_env, 4, env, _layer_outputs, cfg, timeout=TIMEOUT)
    want = dense_moe(tokens(sum(sizes), H, 4), cfg["ids"], cfg["w"], dense_weights(E, H, F, 4))
    got = torch.cat([o[0] for o in outs if o.numel()])
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(o[0], o[1]) for o in outs if o.numel())


def _layer_steps(rank: int, world: int, cfg: dict) -> dict:
    """Outputs and input gradients of ``cfg["name"]`` (twice) and a2a, and the traffic."""
    from moonplan import MoonMoE
    from tests.runtime.oracle import split

    H, F, E, K, dtype = 16, 24, cfg["E"], cfg["K"], cfg["dtype"]
    w = dense_weights(E, H, F, seed=5)
    x = split(tokens(sum(cfg["sizes"]), H, 5), cfg["sizes"])[rank].to(dtype)
    out = {}
    for name in ("a2a-hosts", "a2a"):
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
        for a, b in zip(g["a2a-hosts0"], g["a2a0"], strict=True):
            torch.testing.assert_close(a.float(), b.float(), **tol)


def _step(t: TwoStageTransport, plan, route, x, w, dy, dx_PH=None) -> list[torch.Tensor]:
    """Forward and backward of one step with row-wise experts; every result."""
    view = t.dispatch(x, route, plan, weight_SK=w)
    recv = view.tensor.clone()
    y = t.combine(recv.tanh(), route, w, view.state)
    g, dw = t.combine_backward(dy, route, plan, w, view.state)
    dx = t.dispatch_backward(recv.square() if dx_PH is None else dx_PH, route, view.state)
    return [recv, y, g.clone(), dw, dx]


def _two_forwards(rank: int, world: int, L: int) -> list[str]:
    """Step A's forward, step B's forward, B's backward, A's backward: the same bits as
    each step alone, and as a rerun."""
    from moonplan.comm.group import EPGroup

    group = EPGroup()
    t = TwoStageTransport(group, 256, 6, torch.float32, ranks_per_host=L)
    ids_R = [_tokens(q, torch.float32)[0] for q in range(world)]
    counts = torch.stack([torch.bincount(i.view(-1), minlength=5) for i in ids_R])
    plan = moonplan.plan(counts, align=2)
    ids, x, w = _tokens(rank, torch.float32)
    route = moonplan.route(plan, rank, ids)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank))
    a = _step(t, plan, route, x, w, dy)
    b = _step(t, plan, route, 2 * x + 1, w.flip(-1), -dy)
    fails = [] if all(map(torch.equal, a, _step(t, plan, route, x, w, dy))) else ["rerun"]
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


@pytest.mark.parametrize("L", [2, 1])
def test_two_forwards_before_their_backwards(L: int) -> None:
    assert run_ranks(_two_forwards, 4, L, timeout=TIMEOUT) == [[]] * 4


def _traffic(rank: int, world: int, L: int, K: int) -> dict:
    """``last_traffic`` of every operation, and the pairs counted from the routes alone."""
    from moonplan.comm.group import EPGroup

    group = EPGroup()
    H = 6
    t = TwoStageTransport(group, 512, H, torch.bfloat16, ranks_per_host=L)
    g = torch.Generator().manual_seed(3)
    sizes = [9, 0, 7, 12]
    ids_R = [torch.stack([torch.randperm(10, generator=g)[:K] for _ in range(n)]) if n
             else torch.zeros(0, K, dtype=torch.int64) for n in sizes]  # fmt: skip
    counts = torch.stack([torch.bincount(i.view(-1), minlength=10) for i in ids_R])
    plan = moonplan.plan(counts)
    routes = [moonplan.route(plan, q, ids_R[q]) for q in range(world)]
    x = torch.randn(sizes[rank], H).bfloat16()
    w = torch.rand(sizes[rank], K)
    _step(t, plan, routes[rank], x, w, x, torch.zeros(int(plan.recv_size()[rank]), H).bfloat16())
    return {"traffic": dict(t.last_traffic), "want": _pairs_from_routes(routes, rank, L)}


def _pairs_from_routes(routes, me: int, L: int) -> dict:
    """What rank ``me`` sends in dispatch, counted from every rank's route in Python."""
    host = me // L
    inter = {(s, d // L) for s, d in _token_dests(routes[me]) if d // L != host}
    records_out = sum(1 for d in routes[me].dest_rank.reshape(-1).tolist() if d // L != host)
    intra = set()  # as proxy: (source, token, destination) of sources with my local index
    records_in = 0
    for q, route in enumerate(routes):
        if q % L != me % L:
            continue
        for s, d in _token_dests(route):
            if d // L == host and d != me:
                intra.add((q, s, d))
        flat = route.dest_rank.reshape(-1).tolist()
        records_in += sum(1 for d in flat if d // L == host and d != me)
    return {"inter": len(inter), "records_out": records_out, "intra": len(intra),
            "records_in": records_in}  # fmt: skip


def _token_dests(route) -> set[tuple[int, int]]:
    return {(s, int(d)) for s, row in enumerate(route.dest_rank.tolist()) for d in row}


@pytest.mark.parametrize(("L", "K"), [(2, 8), (2, 3), (4, 8), (1, 8)])
def test_traffic_counts_distinct_token_host_pairs(L: int, K: int) -> None:
    """Rows crossing hosts are the distinct (token, other host) pairs; rows forwarded
    inside a host the distinct (token, other rank of the host) pairs its proxy serves;
    bytes are rows times row bytes plus the documented metadata; combine and
    dispatch-backward send back what dispatch sent out, in total."""
    got = run_ranks(_traffic, 4, L, K, timeout=TIMEOUT)
    row = 6 * 2  # H bf16
    totals: dict[str, list[int]] = {}
    for g in got:
        t, want = g["traffic"], g["want"]
        d = t["dispatch"]
        assert (d.inter_rows, d.intra_rows) == (want["inter"], want["intra"])
        assert d.inter_bytes == want["inter"] * row + 16 * want["records_out"]
        assert d.intra_bytes == want["intra"] * row + 12 * want["records_in"]
        cb = t["combine_backward"]
        assert (cb.inter_rows, cb.intra_rows) == (d.inter_rows, d.intra_rows)
        for op, tr in t.items():
            totals.setdefault(op, [0, 0])
            totals[op][0] += tr.inter_rows
            totals[op][1] += tr.intra_rows
    assert totals["combine"] == totals["dispatch_backward"] == totals["dispatch"]
    if L == 4:
        assert totals["dispatch"][0] == 0  # one host: nothing crosses
    if L == 1:
        assert totals["dispatch"][1] == 0  # hosts of one rank: nothing to forward


def test_ranks_per_host_must_divide_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert hosts_of(4, None) == 4  # unset: one host
    assert hosts_of(4, 2) == 2 and hosts_of(4, 1) == 1
    with pytest.raises(ValueError, match="ranks_per_host = 3 must divide the group's 4 ranks"):
        hosts_of(4, 3)
    with pytest.raises(ValueError, match="must divide"):
        hosts_of(4, 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert hosts_of(4, None) == 2 and hosts_of(4, 4) == 4  # the keyword wins
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE = 3 must divide"):
        hosts_of(4, None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be an integer"):
        hosts_of(4, None)


def test_combine_needs_the_dispatched_weights() -> None:
    from moonplan.comm.group import EPGroup

    t = moonplan.runtime.transports.create(
        "a2a-hosts", EPGroup(), capacity=16, hidden=6, dtype=torch.float32
    )
    ids, x, w = _tokens(0, torch.float32)
    plan = moonplan.plan(torch.bincount(ids.view(-1), minlength=5)[None])
    route = moonplan.route(plan, 0, ids)
    view = t.dispatch(x, route, plan)
    with pytest.raises(ValueError, match="weights given to dispatch"):
        t.combine(view.tensor, route, w, view.state)


def test_triton_token_ops_give_the_reference_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Triton row ops (interpreted on CPU) the transport uses ``token_triton``."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    from moonplan.comm.group import EPGroup
    from moonplan.runtime.row_ops import token_triton

    env = {"MOONPLAN_ROW_OPS": "triton", "TRITON_INTERPRET": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert TwoStageTransport(EPGroup(), 4, 2, torch.float32)._ops is token_triton
    env["LOCAL_WORLD_SIZE"] = "2"
    got = run_ranks(_round_trip, 4, "a2a-hosts", env, timeout=TIMEOUT)
    assert [g["fails"] for g in got] == [[]] * 4
