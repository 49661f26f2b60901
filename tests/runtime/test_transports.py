"""Every registered transport against a plain reference, on 1 to 3 gloo ranks.

Legend: R ranks, S tokens, K top-k, H hidden, P receive rows of this rank, n fetched rows.

The reference rebuilds every rank's tokens from their seeds, so each rank knows which
record lands where without asking the transport. A new transport in the registry is
picked up by the parametrisation (CONTRIBUTING.md, "Adding a transport").
"""

from __future__ import annotations

import pytest
import torch

import moonplan
from moonplan.runtime.transports import registry
from moonplan.testing.dist import run_ranks

pytestmark = pytest.mark.distributed

E, S, K, H, CAP = 5, 7, 2, 6, 64
TIMEOUT = 60


def _tokens(rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [S, K], x [S, H], weight [S, K])`` of ``rank`` (rank 1 has no tokens)."""
    g = torch.Generator().manual_seed(100 + rank)
    n = 0 if rank == 1 else S + rank
    pop_E = torch.tensor([6.0, 1, 1, 2, 1])
    ids = torch.multinomial(pop_E, max(n * K, 1), True, generator=g)[: n * K]
    return ids.view(n, K), torch.randn(n, H, generator=g).to(dtype), torch.rand(n, K, generator=g)


def _dy(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """``dy [S, H]`` of ``rank`` (reproducible on every rank)."""
    S_r = _tokens(rank, dtype)[1].shape[0]
    return torch.randn(S_r, H, generator=torch.Generator().manual_seed(7 + rank)).to(dtype)


def _at_executing_rank(
    plan, world: int, me: int, dtype: torch.dtype, rows_of, affinity: bool
) -> torch.Tensor:
    """``[P, H]``: the rows ``rows_of(q, x, w) [S, K, H]`` of every rank ``q``'s records that
    ``me`` executes, at their receive rows (padding rows zero), routed with ``affinity``."""
    out = torch.zeros(int(plan.recv_size()[me]), H, dtype=dtype)
    for q in range(world):
        ids, x, w = _tokens(q, dtype)
        route = moonplan.route(plan, q, ids, affinity=affinity)
        mine = route.dest_rank == me
        out[route.dest_offset[mine]] = rows_of(q, x, w)[mine]
    return out


def _fsum(rows_SKH: torch.Tensor, w_SK: torch.Tensor) -> torch.Tensor:
    """``sum_k w * row`` in fp32, ascending ``k`` (the documented combine arithmetic)."""
    acc = torch.zeros(rows_SKH.shape[0], H)
    for k in range(rows_SKH.shape[1]):
        acc += w_SK[:, k, None].float() * rows_SKH[:, k].float()
    return acc


def _per_record(rows_SH: torch.Tensor) -> torch.Tensor:
    return rows_SH[:, None].expand(-1, K, -1)


def _experts(rows: torch.Tensor) -> torch.Tensor:
    """A row-wise stand-in for the experts (any function of the row alone would do)."""
    return (rows.float().tanh() * 1.5).to(rows.dtype)


def _round_trip(rank: int, world: int, name: str, env: dict[str, str] | None = None) -> dict:
    import os

    from moonplan.comm.group import EPGroup
    from moonplan.comm.heap_factory import create_heap
    from moonplan.runtime.row_ops import row_ops_for

    os.environ.update(env or {})  # this rank process only (forked)
    group = EPGroup()
    heap = create_heap(group, 1 << 18) if registry.needs_heap(name) else None
    ids_R = [_tokens(q, torch.float32)[0] for q in range(world)]
    counts_RE = torch.stack([torch.bincount(i.view(-1), minlength=E) for i in ids_R])
    fails: list[str] = []
    outs: list[torch.Tensor] = []
    ops = row_ops_for(torch.device("cpu")).__name__.rsplit(".", 1)[1]
    if ops != (env or {}).get("MOONPLAN_ROW_OPS", "torch"):
        fails.append(f"row ops {ops}")
    for dtype in (torch.float32, torch.bfloat16):
        t = registry.create(name, group, capacity=CAP, hidden=H, dtype=dtype, heap=heap)
        fails += [] if t.name == name else [f"named {t.name!r}"]
        for align in (1, 3):  # dense rows first: the padding rows of align 3 held data
            plan = moonplan.plan(counts_RE, align=align)
            fails += [f"{dtype} {f}" for f in _data_path(t, plan, rank, world, dtype, outs)]
    t = registry.create(name, group, capacity=4, hidden=H, dtype=torch.float32, heap=heap)
    return {"fails": fails + _shared_rows(group, t), "outs": outs}


def _same(got: torch.Tensor, want: torch.Tensor, exact: bool) -> bool:
    """Bit-equal (per-record rows), or equal within the token-row rounding (same dtype):
    fp32 sums in another order; bf16 partial sums rounded once per destination rank."""
    if exact or got.dtype != want.dtype:
        return got.dtype == want.dtype and torch.equal(got, want)
    tol = 2e-2 if got.dtype == torch.bfloat16 else 1e-5
    return torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def _data_path(t, plan, rank: int, world: int, dtype: torch.dtype, outs: list) -> list[str]:
    """The four operations in step order, each against the reference; what differs
    (appends the results to ``outs``)."""
    from moonplan.runtime.transports import StaleViewError, Transport

    fails = [] if isinstance(t, Transport) else ["not a Transport"]
    exact = t.rows == "records"
    affinity = t.rows == "tokens"  # as the layer routes for this transport
    ids, x, w = _tokens(rank, dtype)
    route = moonplan.route(plan, rank, ids, affinity=affinity)
    fails += _host_reads_after_puts(t, plan, route, x, w)
    masks = _count_padding_masks()  # this rank process only (forked)
    view = t.dispatch(x, route, plan, weight_SK=w)
    recv = view.tensor.clone()
    if not torch.equal(
        recv,
        _at_executing_rank(plan, world, rank, dtype, lambda q, x, w: _per_record(x), affinity),
    ):
        fails.append("dispatch")
    y = t.combine(_experts(recv), route, w, view.state)
    o_SKH = _per_record(_experts(x))
    if not _same(y, _fsum(o_SKH, w).to(dtype), exact):
        fails.append("combine")
    dy = _dy(rank, dtype)
    g_PH, dw = t.combine_backward(dy, route, plan, w, view.state)

    def g_rows(q, x, w):
        return (w.float()[:, :, None] * _dy(q, dtype).float()[:, None]).to(dtype)

    if not torch.equal(g_PH, _at_executing_rank(plan, world, rank, dtype, g_rows, affinity)):
        fails.append("combine_backward rows")
    if not _same(dw, (dy.float()[:, None] * o_SKH.float()).sum(-1).to(w.dtype), exact):
        fails.append("dweight")
    called: list[int] = []
    dx_PH = (recv.float() ** 2).to(dtype)
    dx = t.dispatch_backward(dx_PH, route, view.state, after_publish=_counter(called))
    want_dx = _fsum(_per_record((x.float() ** 2).to(dtype)), torch.ones(x.shape[0], K))
    if called != [1] or not _same(dx, want_dx.to(dtype), exact):
        fails.append(f"dispatch_backward (after_publish calls {called})")
    if not torch.equal(t.dispatch_backward(dx_PH, route, view.state), dx):
        fails.append("dispatch_backward without after_publish")
    outs += [y, g_PH, dw, dx]
    if len(masks) != 1:
        fails.append(f"padding mask built {len(masks)} times in a step")
    try:
        view.tensor  # noqa: B018 - combine_backward dispatched since: the view is stale
        fails.append("stale view")
    except StaleViewError:
        pass
    return fails


def _count_padding_masks() -> list[int]:
    """The ranks of every ``padding_mask`` call from here on (both data paths' modules)."""
    from moonplan.runtime.transports import records, tokens

    calls: list[int] = []
    real = records.padding_mask

    def counted(plan, rank: int, size: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
        calls.append(rank)
        return real(plan, rank, size)

    records.padding_mask = tokens.padding_mask = counted  # type: ignore[assignment]
    return calls


class _HostReads(torch.Tensor):
    """A plan tensor that logs every host read of its values: of itself, or of an entry
    or a stack of entries of it (``int(plan.target[rank])``). What is computed from it
    otherwise is a plain tensor (reading received rows is not a read of the plan)."""

    log: list[str] = []  # noqa: RUF012 - set per dispatch by _host_reads_after_puts
    READS = ("__int__", "__float__", "__bool__", "__index__", "item", "tolist", "nonzero")
    ENTRIES = ("__getitem__", "stack", "select")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if name in cls.READS:
            cls.log.append(f"read {name}")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        keep = name in cls.ENTRIES and isinstance(out, torch.Tensor)
        return out.as_subclass(cls) if keep else out


def _host_reads_after_puts(t, plan, route, x, w) -> list[str]:  # type: ignore[no-untyped-def]
    """A dispatch reads the plan on the host before it issues its puts, none after (a
    read after them would wait for the communication)."""
    import dataclasses

    from moonplan.plan.plan_type import TENSOR_FIELDS

    fields = {f: getattr(plan, f).as_subclass(_HostReads) for f in TENSOR_FIELDS}
    log = _HostReads.log = []
    real_put = t.put_rows
    t.put_rows = lambda puts: log.append("put") or real_put(puts)
    try:
        t.dispatch(x, route, dataclasses.replace(plan, **fields), weight_SK=w)
    finally:
        del t.put_rows
    late = sum(e.startswith("read") for e in log[log.index("put") :]) if "put" in log else -1
    return [] if late == 0 else [f"dispatch: host reads of the plan after its puts: {log}"]


def _counter(calls: list[int]):
    return lambda: calls.append(1)


def _shared_rows(group, t) -> list[str]:
    """``alloc_shared`` / ``publish`` / ``fetch_rows``: rows of every rank, in asked order."""
    R, me = group.size, group.rank
    buf = t.alloc_shared((5, 2, 3), torch.float32)
    buf.local.copy_(torch.arange(30.0).view(5, 2, 3) + 100 * me)
    t.publish()
    g = torch.Generator().manual_seed(me)
    n = 4 + me
    rank_n, row_n = torch.randint(0, R, (n,), generator=g), torch.randint(0, 5, (n,), generator=g)
    got = t.fetch_rows(buf, rank_n, row_n)
    t.publish()
    want = torch.arange(30.0).view(5, 2, 3)[row_n] + 100 * rank_n[:, None, None].float()
    return [] if torch.equal(got, want) else ["fetch_rows"]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", registry.names())
def test_round_trip_matches_reference(name: str, world: int) -> None:
    got = run_ranks(_round_trip, world, name, timeout=TIMEOUT)
    assert [g["fails"] for g in got] == [[]] * world


def _assert_same_bits(runs: list[list[dict]]) -> None:
    """Every run passed its reference and gave the same bits on every rank."""
    for per_rank in zip(*runs, strict=True):
        first = per_rank[0]["outs"]
        assert len(first) == 16  # 2 dtypes x 2 aligns x (y, g, dweight, dx)
        for got in per_rank:
            assert got["fails"] == []
            for a, b in zip(first, got["outs"], strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("rows", ["tokens", "records"])
def test_heap_and_all_to_all_agree_bit_for_bit(rows: str) -> None:
    """Same rows, same arithmetic: both built-in transports give the same bits, and a
    rerun gives them again."""
    heap, a2a = (registry.builtin_name(base, rows) for base in ("heap", "a2a"))
    _assert_same_bits([run_ranks(_round_trip, 3, n, timeout=TIMEOUT) for n in (heap, a2a, heap)])


@pytest.mark.slow  # Triton interpreter on 3 ranks (1.6-4 s)
def test_heap_with_triton_row_ops_matches_reference() -> None:
    """The heap's peer stores and loads through the Triton kernels (interpreted on CPU)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    env = {"MOONPLAN_ROW_OPS": "triton", "TRITON_INTERPRET": "1"}
    for name in (registry.builtin_name("heap", rows) for rows in ("tokens", "records")):
        kernels = run_ranks(_round_trip, 2, name, env, timeout=TIMEOUT)
        _assert_same_bits([kernels, run_ranks(_round_trip, 2, name, timeout=TIMEOUT)])


def _zero_copy(rank: int, world: int) -> bool:
    from moonplan.comm.group import EPGroup
    from moonplan.comm.heap_factory import create_heap

    group = EPGroup()
    name = registry.builtin_name("heap", "records")  # token rows are expanded locally
    t = registry.create(name, group, capacity=CAP, hidden=H, dtype=torch.float32,
                        heap=create_heap(group, 1 << 16))  # fmt: skip
    ids, x, _ = _tokens(rank, torch.float32)
    counts = group.all_gather(torch.bincount(ids.reshape(-1), minlength=E))
    plan = moonplan.plan(counts)
    view = t.dispatch(x, moonplan.route(plan, rank, ids), plan)
    return view.tensor.data_ptr() == t.recv.local.data_ptr()  # type: ignore[attr-defined]


def test_heap_receive_view_is_the_heap_buffer() -> None:
    assert all(run_ranks(_zero_copy, 2, timeout=TIMEOUT))


def test_registry_names_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"heap", "a2a"} <= set(registry.names())
    with pytest.raises(
        ValueError,
        match=f"unknown transport 'nope'; known transports: {', '.join(registry.names())}",
    ):
        registry.create("nope", None, capacity=1, hidden=1, dtype=torch.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a symmetric heap"):
        registry.create("heap", None, capacity=1, hidden=1, dtype=torch.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is taken"):
        registry.register("heap", lambda *a, **k: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="is taken"):
        registry.register("auto", lambda *a, **k: None)  # type: ignore[arg-type, return-value]
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    made = []
    registry.register("mine", lambda group, **kw: made.append((group, kw)) or "t")  # type: ignore[arg-type, return-value]
    assert "mine" in registry.names() and not registry.needs_heap("mine")
    assert registry.create("mine", "g", capacity=3, hidden=2, dtype=torch.float32) == "t"  # type: ignore[arg-type, comparison-overlap]
    assert made == [("g", {"capacity": 3, "hidden": 2, "dtype": torch.float32, "heap": None})]
    # options read from the environment: resolved once (read_options), passed as keywords
    registry.register("env", lambda group, **kw: made.append(kw) or "e", options=lambda R: {"x": R})  # type: ignore[arg-type, return-value]
    assert registry.read_options("env", 4) == {"x": 4} and registry.read_options("auto", 4) == {}
    registry.create("env", "g", capacity=1, hidden=1, dtype=torch.float32, options={"x": 2})  # type: ignore[arg-type]
    assert made[-1]["x"] == 2


def test_layer_rejects_unknown_transport_listing_known() -> None:
    from moonplan import MoonMoE

    with pytest.raises(ValueError, match=f"known transports: {', '.join(registry.names())}"):
        MoonMoE(4, 4, 2, 1, router=lambda x: None, transport="nccl")


@pytest.mark.slow  # 4 ranks as 2 hosts, twice (1.4-2.2 s each)
@pytest.mark.parametrize("ranks_per_host", [1, 2])
def test_two_stage_on_two_hosts_matches_reference(ranks_per_host: int) -> None:
    """4 gloo ranks as hosts of 2 (and of 1: every token crosses to each rank once)."""
    env = {"LOCAL_WORLD_SIZE": str(ranks_per_host)}
    got = run_ranks(_round_trip, 4, "a2a-hosts", env, timeout=TIMEOUT)
    assert [g["fails"] for g in got] == [[]] * 4
    again = run_ranks(_round_trip, 4, "a2a-hosts", env, timeout=TIMEOUT)
    _assert_same_bits([got, again])


def test_two_stage_needs_whole_hosts() -> None:
    from moonplan.runtime.transports.two_stage import TwoStageTokenTransport

    class _Group:
        size, rank, device = 4, 0, torch.device("cpu")

    with pytest.raises(ValueError, match="must divide the 4 ranks, got 3"):
        TwoStageTokenTransport(_Group(), 4, 2, torch.float32, ranks_per_host=3)  # type: ignore[arg-type]


def test_a_factory_that_makes_no_transport_is_refused_when_the_layer_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The layer checks once that what a registered factory made has every member of the
    ``Transport`` protocol (capabilities included), rather than probing it step by step."""
    from moonplan import MoonMoE
    from moonplan.comm.errors import ContractError

    class Half:  # a name and nothing that moves rows
        name = "half"

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register("half", lambda group, **kw: Half())  # type: ignore[arg-type, return-value]
    with pytest.raises(ContractError, match="made a Half, not a Transport"):
        MoonMoE(8, 8, 4, 2, transport="half")
