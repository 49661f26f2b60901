"""MoonMoE over real process groups equals the single-process layer and a dense oracle."""

from __future__ import annotations

import pytest
import torch

from moonplan.runtime.transports.registry import builtin_name
from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_moe, dense_weights, split, tokens

pytestmark = pytest.mark.distributed


TOKENS = {base: builtin_name(base, "tokens") for base in ("heap", "a2a")}
RECORDS = {base: builtin_name(base, "records") for base in ("heap", "a2a")}


def _fixed_router(ids_TK: torch.Tensor, w_TK: torch.Tensor, offset: int):
    """A router callable returning precomputed ids/weights for this rank's slice."""

    def route(x_SH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        S = x_SH.shape[0]
        return ids_TK[offset : offset + S], w_TK[offset : offset + S] * (1 + 0 * x_SH.sum())

    return route


def _layer_outputs(rank: int, world: int, cfg: dict) -> torch.Tensor:
    from moonplan import MoonMoE

    H, F, E, K = cfg["H"], cfg["F"], cfg["E"], cfg["K"]
    w = dense_weights(E, H, F, seed=cfg["seed"])
    x_r = split(tokens(sum(cfg["sizes"]), H, cfg["seed"]), cfg["sizes"])[rank]
    offset = sum(cfg["sizes"][:rank])
    router = _fixed_router(cfg["ids"], cfg["w"], offset) if "ids" in cfg else "softmax"
    layer = MoonMoE(
        H,
        F,
        E,
        K,
        slots=cfg.get("slots"),
        align=cfg.get("align", 1),
        router=router,
        transport=cfg.get("transport", "auto"),
        balance=cfg.get("balance", "exact"),
        overlap=cfg.get("overlap", True),
    )
    layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
    outs = [layer(x_r).detach() for _ in range(cfg.get("steps", 1))]
    return torch.stack(outs) if outs else torch.zeros(0)


def _hot_ids(T: int, E: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[: T // 2, 0] = 0  # expert 0 takes far more than a rank's share
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return ids, w


CASES = [
    # (world, E, sizes, slots, align, transport, hot, K); "auto" is the heap here
    (1, 5, [7], None, 1, "auto", False, 2),
    (2, 4, [9, 5], None, 1, "auto", True, 2),
    (2, 3, [0, 11], None, 1, "auto", True, 2),  # a rank with no tokens, E mod R != 0
    (3, 2, [6, 4, 5], None, 4, "auto", True, 2),  # E < R
    (3, 7, [8, 8, 8], 0, 1, "auto", True, 2),  # slots = 0: every replica direct
    (4, 13, [5, 0, 7, 6], 2, 2, "auto", True, 2),
    (3, 6, [7, 5, 6], None, 1, "a2a", True, 2),  # the all-to-all transport
    # one row per (token, destination rank) on both transports, and per record
    (4, 16, [6, 5, 0, 7], None, 1, TOKENS["heap"], True, 8),  # top-8: few ranks per token
    (3, 12, [5, 6, 4], 0, 2, TOKENS["a2a"], True, 8),
    (3, 2, [6, 4, 5], None, 4, TOKENS["a2a"], True, 2),
    (3, 2, [6, 4, 5], None, 4, TOKENS["heap"], True, 2),
    (2, 3, [0, 11], 0, 1, TOKENS["heap"], True, 2),
    (4, 13, [5, 0, 7, 6], 0, 2, RECORDS["a2a"], True, 8),
    (3, 6, [7, 5, 6], None, 1, RECORDS["heap"], True, 2),
]


@pytest.mark.parametrize(("world", "E", "sizes", "slots", "align", "transport", "hot", "K"), CASES)
def test_layer_matches_dense_oracle(
    world: int, E: int, sizes: list[int], slots, align: int, transport: str, hot: bool, K: int
) -> None:
    H, F, seed = 16, 24, 7
    T = sum(sizes)
    cfg = {
        "H": H,
        "F": F,
        "E": E,
        "K": K,
        "seed": seed,
        "sizes": sizes,
        "slots": slots,
        "align": align,
        "transport": transport,
        "steps": 2,
    }
    if hot:
        cfg["ids"], cfg["w"] = _hot_ids(T, E, K, seed)
    outs = run_ranks(_layer_outputs, world, cfg, timeout=120)
    w = dense_weights(E, H, F, seed)
    x = tokens(T, H, seed)
    if hot:
        ids, wk = cfg["ids"], cfg["w"]
    else:
        prob = torch.softmax((x @ w["router_weight"].T).float(), -1)
        wk, ids = torch.topk(prob, K, -1)
        wk = wk / wk.sum(-1, keepdim=True)
    want = dense_moe(x, ids, wk, w).float()
    got = torch.cat([o[0] for o in outs if o.numel()] or [torch.zeros(0, H)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for o in outs:  # the second step (with resident slots) gives the same output
        if o.numel():
            assert torch.equal(o[0], o[1])


def test_static_mode_gives_the_same_output() -> None:
    """Planning off (static EP) computes the same function, only slower under skew."""
    T = 12
    cfg = {"H": 16, "F": 24, "E": 4, "K": 2, "seed": 2, "sizes": [6, 6], "steps": 1}
    cfg["ids"], cfg["w"] = _hot_ids(T, 4, 2, 2)
    balanced = run_ranks(_layer_outputs, 2, cfg, timeout=60)
    static = run_ranks(_layer_outputs, 2, {**cfg, "balance": "off"}, timeout=60)
    for a, b in zip(balanced, static, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _bf16_outputs(rank: int, world: int, sizes: list[int], transport: str) -> torch.Tensor:
    from moonplan import MoonMoE

    H, F, E, K = 16, 32, 5, 2
    w = dense_weights(E, H, F, seed=4)
    x = split(tokens(sum(sizes), H, 4), sizes)[rank]
    layer = MoonMoE(H, F, E, K, dtype=torch.bfloat16, transport=transport)
    layer.load_dense(*(w[k].bfloat16() for k in ("router_weight", "gate_up", "down")))
    with torch.no_grad():
        return layer(x.bfloat16()).float()


@pytest.mark.parametrize("transport", ["auto", TOKENS["heap"], TOKENS["a2a"], RECORDS["a2a"]])
def test_bf16_tokens_within_bf16_rounding(transport: str) -> None:
    """Token rows round a partial sum per destination rank to bf16: still a few ulps."""
    sizes = [9, 4, 7]
    got = torch.cat(run_ranks(_bf16_outputs, 3, sizes, transport, timeout=60))
    w = {k: v.bfloat16().float() for k, v in dense_weights(5, 16, 32, seed=4).items()}
    x = tokens(sum(sizes), 16, 4).bfloat16().float()
    prob = torch.softmax(x @ w["router_weight"].T, -1)
    wk, ids = torch.topk(prob, 2, -1)
    want = dense_moe(x, ids, wk / wk.sum(-1, keepdim=True), w).float()
    torch.testing.assert_close(got, want, rtol=4e-2, atol=4e-2)  # a few bf16 ulps


def test_bf16_heap_and_all_to_all_agree_bit_for_bit() -> None:
    sizes = [9, 4, 7]
    heap, a2a = (
        torch.cat(run_ranks(_bf16_outputs, 3, sizes, t, timeout=60)) for t in TOKENS.values()
    )
    assert torch.equal(heap, a2a)


def test_single_expert_top1() -> None:
    """E = 1: every record belongs to one expert, split over every rank."""
    cfg = {"H": 8, "F": 8, "E": 1, "K": 1, "seed": 9, "sizes": [5, 0, 7], "steps": 1}
    outs = run_ranks(_layer_outputs, 3, cfg, timeout=60)
    w = dense_weights(1, 8, 8, 9)
    x = tokens(12, 8, 9)
    ones = torch.ones(12, 1)
    want = dense_moe(x, torch.zeros(12, 1, dtype=torch.long), ones, w).float()
    got = torch.cat([o[0] for o in outs if o.numel()])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _growing(rank: int, world: int) -> list[torch.Tensor]:
    from moonplan import MoonMoE

    w = dense_weights(4, 8, 12, seed=6)
    layer = MoonMoE(8, 12, 4, 2, max_tokens=1)  # far too small: buffers must grow
    layer.load_dense(w["router_weight"], w["gate_up"], w["down"])
    outs = []
    for n in (3, 9, 2):  # grows at the first and second step, not at the third
        x = tokens(n * world, 8, 6 + n)[rank * n : (rank + 1) * n]
        outs.append(layer(x).detach())
    return outs


def test_receive_buffers_grow_collectively() -> None:
    got = run_ranks(_growing, 2, timeout=60)
    w = dense_weights(4, 8, 12, seed=6)
    for step, n in enumerate((3, 9, 2)):
        x = tokens(n * 2, 8, 6 + n)
        prob = torch.softmax(x @ w["router_weight"].T, -1)
        wk, ids = torch.topk(prob, 2, -1)
        want = dense_moe(x, ids, wk / wk.sum(-1, keepdim=True), w).float()
        torch.testing.assert_close(torch.cat([g[step] for g in got]), want, rtol=1e-5, atol=1e-5)


def test_state_dict_of_earlier_releases_loads() -> None:
    """Before MoonMoE held a MoonExperts its expert parameters were ``gate_up``/``down``:
    such a state dict loads into the new keys, bit for bit."""
    from moonplan import MoonMoE, checkpoint

    torch.manual_seed(0)
    src = checkpoint.per_expert_keys(MoonMoE(8, 12, 4, 2), False)  # the home-rows layout
    old = {
        {"experts.gate_up_proj": "gate_up", "experts.down_proj": "down"}.get(k, k): v.clone()
        for k, v in src.state_dict().items()
    }
    assert "gate_up" in old and "experts.gate_up_proj" not in old
    dst = MoonMoE(8, 12, 4, 2)
    dst.load_state_dict(old)
    assert torch.equal(dst.gate_up, src.gate_up) and torch.equal(dst.down, src.down)


def _traffic(rank: int, world: int, transport: str) -> dict:
    import moonplan
    from moonplan import MoonMoE

    H, E, K, S = 8, 16, 8, 12
    ids, wk = _hot_ids(S * world, E, K, seed=5)
    layer = MoonMoE(H, 12, E, K, router=_fixed_router(ids, wk, S * rank), transport=transport)
    layer(tokens(S * world, H, 5)[S * rank : S * (rank + 1)])
    stats, plan = layer.last_stats, layer.runtime.last_plan
    assert stats is not None and plan is not None
    tokens_route = moonplan.route(plan, rank, ids[S * rank : S * (rank + 1)], affinity=True)
    return {
        "stats": (stats.records, stats.rows_sent, stats.bytes_sent, stats.rows_per_record),
        "unique": tokens_route.sent_rows,
        "executed": int(plan.target[rank]),
        "heap": stats.heap,
    }


@pytest.mark.parametrize("transport", [TOKENS["heap"], RECORDS["a2a"]])
def test_last_stats_report_records_rows_and_bytes(transport: str) -> None:
    K, S, row = 8, 12, 8 * 4  # row: H = 8 fp32 values
    for got in run_ranks(_traffic, 3, transport, timeout=60):
        records, rows, sent, per_record = got["stats"]
        assert records == S * K and per_record == rows / records
        assert got["heap"] == ("shm" if transport.startswith("heap") else "")
        if transport in RECORDS.values():
            assert rows == records and sent == (records + got["executed"]) * row
        else:  # one row per (token, destination): fewer rows than records at top-8
            assert rows == got["unique"] < records and S <= rows
            assert rows * row + records * 8 < sent <= (rows + got["executed"]) * row + records * 8
