"""Token-once row operations: the torch reference (``token_torch``) against plain Python
loops, and the Triton kernels (``token_triton``, interpreted on CPU) against the reference,
bit for bit.

Legend: T token-buffer rows, P expert-grouped rows (records and padding), H hidden,
R ranks, S tokens of a rank, K top-k.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moonplan
from moonplan.runtime.row_ops import token_torch as ref
from moonplan.runtime.row_ops import torch as rows
from moonplan.runtime.transports.records import weighted_sum

triton_mod = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
from moonplan.runtime.row_ops import token_triton as ker  # noqa: E402
from tests.runtime.row_ops.test_triton_twins import _same_bits, interpret  # noqa: E402, F401 (a fixture)

DTYPES = [torch.float32, torch.bfloat16]
SPECIAL = [float("nan"), float("inf"), -float("inf"), 1e-40, -1e-39, 0.0, -0.0, 3e38]


def _gather_combine(views, dest_SK, off_SK, w_SK, dtype):  # type: ignore[no-untyped-def]
    """Per-record combine: every record's output row, then ``sum_k w * o`` in fp32."""
    S, K = dest_SK.shape
    o_NH = torch.empty(S * K, views[0].shape[1], dtype=views[0].dtype)
    rows.gather_rows(views, dest_SK.reshape(-1), off_SK.reshape(-1), o_NH)
    return weighted_sum(o_NH.view(S, K, -1), w_SK, dtype)


def _case(T: int, P: int, H: int, dtype: torch.dtype, seed: int, pad: float = 0.2):
    """Random token rows, grouped rows, indices in ``[-1, T)`` (about ``pad`` padding)
    with many duplicates, and weights."""
    gen = torch.Generator().manual_seed(seed)
    tokens_TH = torch.randn(T, H, generator=gen).to(dtype)
    rows_PH = torch.randn(P, H, generator=gen).to(dtype)
    idx_P = torch.randint(0, max(T, 1), (P,), generator=gen) if T else torch.zeros(P)
    idx_P = torch.where(torch.rand(P, generator=gen) < pad, -1, idx_P.long())
    if T == 0:
        idx_P = torch.full((P,), -1, dtype=torch.int64)
    w_P = torch.rand(P, generator=gen).to(dtype)
    return tokens_TH, rows_PH, idx_P, w_P


# ---- plain loops (the definitions, one element at a time) ----------------------------------
def _loop_expand(tokens_TH: torch.Tensor, idx_P: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(idx_P.numel(), tokens_TH.shape[1], dtype=tokens_TH.dtype)
    for p, i in enumerate(idx_P.tolist()):
        if i >= 0:
            out[p] = tokens_TH[i]
    return out


def _loop_reduce(rows_PH, idx_P, T, w_P=None, out_dtype=None) -> torch.Tensor:
    acc = torch.zeros(T, rows_PH.shape[1], dtype=torch.float32)
    for p, t in enumerate(idx_P.tolist()):  # ascending p
        if t >= 0:
            term = rows_PH[p].float()
            acc[t] += term if w_P is None else w_P[p].float() * term
    return acc.to(out_dtype or rows_PH.dtype)


def _loop_dot(a_PH: torch.Tensor, b_TH: torch.Tensor, idx_P: torch.Tensor) -> torch.Tensor:
    """``row_dot``'s order spelled out: 128 lanes over column strides, then halving."""
    out = torch.zeros(idx_P.numel(), dtype=torch.float32)
    H = a_PH.shape[1]
    for p, i in enumerate(idx_P.tolist()):
        if i < 0:
            continue
        lane = [torch.tensor(0.0) for _ in range(ref.DOT_BLOCK)]
        for h in range(H):
            lane[h % ref.DOT_BLOCK] = (
                lane[h % ref.DOT_BLOCK] + a_PH[p, h].float() * b_TH[i, h].float()
            )
        while len(lane) > 1:
            half = len(lane) // 2
            lane = [lane[j] + lane[j + half] for j in range(half)]
        out[p] = lane[0]
    return out


# ---- reference against the loops -----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("T", "P", "H"), [(7, 40, 33), (1, 9, 5), (0, 6, 4), (5, 0, 8), (4, 6, 0)])
def test_reference_matches_loops(T: int, P: int, H: int, dtype: torch.dtype) -> None:
    tokens_TH, rows_PH, idx_P, w_P = _case(T, P, H, dtype, seed=T * 31 + P)
    assert _same_bits(ref.expand_rows(tokens_TH, idx_P), _loop_expand(tokens_TH, idx_P))
    for w in (None, w_P):
        for out_dtype in (None, torch.float32):
            got = ref.reduce_rows(rows_PH, idx_P, T, w, out_dtype)
            assert _same_bits(got, _loop_reduce(rows_PH, idx_P, T, w, out_dtype))
    b_TH = tokens_TH
    assert _same_bits(ref.row_dot(rows_PH, b_TH, idx_P), _loop_dot(rows_PH, b_TH, idx_P))


def test_row_dot_is_a_dot_product() -> None:
    """Its order aside, ``row_dot`` is the fp32 dot product (H over several lane blocks)."""
    tokens_TH, rows_PH, idx_P, _ = _case(6, 30, 1000, torch.float32, seed=3)
    want = (rows_PH.double() * ref.expand_rows(tokens_TH, idx_P).double()).sum(1)
    got = ref.row_dot(rows_PH, tokens_TH, idx_P)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[idx_P < 0], torch.zeros(int((idx_P < 0).sum())))


@given(
    st.integers(0, 6),
    st.lists(st.integers(-1, 5), max_size=24),
    st.integers(1, 9),
    st.sampled_from(DTYPES),
    st.booleans(),
)
def test_reference_properties(T: int, dst: list[int], H: int, dtype, weighted: bool) -> None:
    """Random segments (duplicates, padding, empty rows): loop-equal, and reusing one
    :class:`Segments` for weighted and unweighted sums gives what the raw rows give."""
    idx_P = torch.tensor([d if d < T else -1 for d in dst], dtype=torch.int64)
    gen = torch.Generator().manual_seed(len(dst) * 7 + T)
    rows_PH = torch.randn(len(dst), H, generator=gen).to(dtype)
    w_P = torch.rand(len(dst), generator=gen).to(dtype) if weighted else None
    seg = ref.segments(idx_P, T)
    got = ref.reduce_rows(rows_PH, seg, T, w_P, torch.float32)
    assert _same_bits(got, _loop_reduce(rows_PH, idx_P, T, w_P, torch.float32))
    assert _same_bits(got, ref.reduce_rows(rows_PH, idx_P, T, w_P, torch.float32))
    # CSR: every record that hits a row is in exactly that row's segment, ascending
    for t in range(T):
        ids = seg.order_P[seg.offsets_T1[t] : seg.offsets_T1[t + 1]].tolist()
        assert ids == (idx_P == t).nonzero().flatten().tolist()


# ---- kernels against the reference ---------------------------------------------------------
@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("T", "P", "H"), [(7, 40, 33), (3, 17, 300), (1, 20, 129), (0, 5, 8), (6, 0, 8), (4, 5, 0)]
)
def test_kernels_match_reference(T: int, P: int, H: int, dtype: torch.dtype) -> None:
    tokens_TH, rows_PH, idx_P, w_P = _case(T, P, H, dtype, seed=T * 13 + H)
    assert _same_bits(ker.expand_rows(tokens_TH, idx_P), ref.expand_rows(tokens_TH, idx_P))
    seg = ref.segments(idx_P, T)
    for w in (None, w_P, w_P.float()):
        for out_dtype in (None, torch.float32, torch.bfloat16):
            got = ker.reduce_rows(rows_PH, seg, T, w, out_dtype)
            assert _same_bits(got, ref.reduce_rows(rows_PH, idx_P, T, w, out_dtype))
    assert _same_bits(
        ker.row_dot(rows_PH, tokens_TH, idx_P), ref.row_dot(rows_PH, tokens_TH, idx_P)
    )


@pytest.mark.usefixtures("interpret")
@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_special_values(dtype: torch.dtype) -> None:
    """NaN, inf, subnormals, signed zeros and overflow, in rows and padding rows."""
    T, P, H = 3, 12, 140
    tokens_TH, rows_PH, idx_P, w_P = _case(T, P, H, torch.float32, seed=9)
    rows_PH[:, : len(SPECIAL)] = torch.tensor(SPECIAL)
    tokens_TH[:, -len(SPECIAL) :] = torch.tensor(SPECIAL)
    rows_PH, tokens_TH, w_P = rows_PH.to(dtype), tokens_TH.to(dtype), (w_P * 3).to(dtype)
    idx_P[0] = -1  # padding whose row holds NaN/inf: its dot is still zero
    assert _same_bits(ker.expand_rows(tokens_TH, idx_P), ref.expand_rows(tokens_TH, idx_P))
    for w in (None, w_P):
        for out_dtype in (torch.float32, torch.bfloat16):
            got = ker.reduce_rows(rows_PH, idx_P, T, w, out_dtype)
            assert _same_bits(got, ref.reduce_rows(rows_PH, idx_P, T, w, out_dtype))
    got = ker.row_dot(rows_PH, tokens_TH, idx_P)
    assert _same_bits(got, ref.row_dot(rows_PH, tokens_TH, idx_P)) and float(got[0]) == 0.0


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("dtype", DTYPES)
def test_adversarial_layouts(dtype: torch.dtype) -> None:
    """All padding; one token with every record; round robin; every record on row 0."""
    T, P, H = 5, 37, 130
    tokens_TH, rows_PH, _, w_P = _case(T, P, H, dtype, seed=5)
    layouts = {
        "all padding": torch.full((P,), -1),
        "one token": torch.full((P,), 2),
        "round robin": torch.arange(P) % T,
        "first": torch.zeros(P, dtype=torch.int64),
    }
    for name, idx_P in layouts.items():
        out = ker.expand_rows(tokens_TH, idx_P)
        assert _same_bits(out, ref.expand_rows(tokens_TH, idx_P)), name
        for w in (None, w_P):
            got = ker.reduce_rows(rows_PH, idx_P, T, w, torch.float32)
            assert _same_bits(got, ref.reduce_rows(rows_PH, idx_P, T, w, torch.float32)), name
        got = ker.row_dot(rows_PH, tokens_TH, idx_P)
        assert _same_bits(got, ref.row_dot(rows_PH, tokens_TH, idx_P)), name
    assert not ref.reduce_rows(rows_PH, torch.full((P,), -1), T).any()


@pytest.mark.usefixtures("interpret")
def test_expand_into_out_and_strided_inputs() -> None:
    """``out_PH`` is written in place (row stride of a wider buffer); strided inputs."""
    tokens_TH, rows_PH, idx_P, _ = _case(6, 21, 40, torch.bfloat16, seed=2)
    wide_tokens = torch.randn(6, 50).bfloat16()[:, 5:45].copy_(tokens_TH)
    for impl in (ref, ker):
        buf = torch.full((21, 48), 7.0).bfloat16()
        out = impl.expand_rows(wide_tokens, idx_P, buf[:, 4:44])
        assert out.data_ptr() == buf[:, 4:44].data_ptr()
        assert _same_bits(out, _loop_expand(tokens_TH, idx_P))
        assert bool((buf[:, :4] == 7).all() and (buf[:, 44:] == 7).all())
    cols = rows_PH.t().contiguous().t()  # column-major rows
    a = ker.reduce_rows(cols, idx_P, 6, None, torch.float32)
    assert _same_bits(a, ref.reduce_rows(rows_PH, idx_P, 6, None, torch.float32))
    assert _same_bits(ker.row_dot(cols, tokens_TH, idx_P), ref.row_dot(rows_PH, tokens_TH, idx_P))


@pytest.mark.usefixtures("interpret")
@given(
    st.integers(0, 5),
    st.lists(st.integers(-1, 4), max_size=20),
    st.integers(1, 140),
    st.sampled_from(DTYPES),
)
def test_kernels_property(T: int, dst: list[int], H: int, dtype: torch.dtype) -> None:
    idx_P = torch.tensor([d if d < T else -1 for d in dst], dtype=torch.int64)
    gen = torch.Generator().manual_seed(len(dst) + 100 * H)
    tokens_TH = torch.randn(T, H, generator=gen).to(dtype)
    rows_PH = torch.randn(len(dst), H, generator=gen).to(dtype)
    w_P = torch.rand(len(dst), generator=gen)
    assert _same_bits(ker.expand_rows(tokens_TH, idx_P), ref.expand_rows(tokens_TH, idx_P))
    got = ker.reduce_rows(rows_PH, idx_P, T, w_P, dtype)
    assert _same_bits(got, ref.reduce_rows(rows_PH, idx_P, T, w_P, dtype))
    assert _same_bits(
        ker.row_dot(rows_PH, tokens_TH, idx_P), ref.row_dot(rows_PH, tokens_TH, idx_P)
    )


# ---- the token-buffer contract of route() --------------------------------------------------
def _token_dispatch(plan, ids, x, d: int):
    """Destination ``d``'s token buffer and per-grouped-row token row (``-1``: padding),
    as the transports will fill them (``moonplan/plan/route_rows.py``)."""
    R, H = plan.num_ranks, x[0].shape[1]
    tokens_TH = torch.zeros(int(plan.target[d]), H)
    src_row_P = torch.full((int(plan.recv_size()[d]),), -1, dtype=torch.int64)
    for s in range(R):
        route = moonplan.route(plan, s, ids[s], affinity=True)
        mine_U = route.unique_dest == d
        tokens_TH[route.unique_offset[mine_U]] = x[s][route.unique_token[mine_U]]
        at_d = route.dest_rank == d
        src_row_P[route.dest_offset[at_d]] = route.token_row()[at_d]
    return tokens_TH, src_row_P


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_route_contract(monkeypatch: pytest.MonkeyPatch, impl: str) -> None:
    """Token-once dispatch + ``expand_rows`` builds the same expert-grouped rows as
    per-record dispatch; ``reduce_rows`` at the destination, then over destinations at
    the source, gives per-record combine's result (another summation order: close)."""
    if impl == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops = ker if impl == "triton" else ref
    gen = torch.Generator().manual_seed(4)
    R, E, S, K, H = 3, 6, 10, 4, 24
    pop_E = torch.tensor([30.0, 1, 1, 6, 1, 1])
    ids = [torch.multinomial(pop_E, S * K, True, generator=gen).view(S, K) for _ in range(R)]
    plan = moonplan.plan(
        torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids]), align=4
    )
    x = [torch.randn(S, H, generator=gen) for _ in range(R)]
    want = [torch.zeros(int(c), H) for c in plan.recv_size()]
    for s in range(R):
        route = moonplan.route(plan, s, ids[s], affinity=True)
        rows.scatter_rows(x[s], route.dest_rank.reshape(-1), route.dest_offset.reshape(-1), K, want)
    outs, back = [], []
    w = [torch.rand(S, K, generator=gen) for _ in range(R)]
    for d in range(R):
        tokens_TH, src_row_P = _token_dispatch(plan, ids, x, d)
        grouped_PH = ops.expand_rows(tokens_TH, src_row_P)
        assert torch.equal(grouped_PH[src_row_P >= 0], want[d][src_row_P >= 0])
        outs.append(grouped_PH * 2 + 1)  # the "experts"
        w_P = torch.zeros(src_row_P.numel())
        for s in range(R):
            route = moonplan.route(plan, s, ids[s], affinity=True)
            at_d = route.dest_rank == d
            w_P[route.dest_offset[at_d]] = w[s][at_d]
        back.append(ops.reduce_rows(outs[d], src_row_P, tokens_TH.shape[0], w_P, torch.float32))
    for s in range(R):
        route = moonplan.route(plan, s, ids[s], affinity=True)
        want_SH = _gather_combine(outs, route.dest_rank, route.dest_offset, w[s], torch.float32)
        # source side: the token's returned rows, one per destination, summed
        got_U = torch.stack(
            [
                back[d][o]
                for d, o in zip(
                    route.unique_dest.tolist(), route.unique_offset.tolist(), strict=True
                )
            ]
        )
        got_SH = ops.reduce_rows(got_U, route.unique_token, S, None, torch.float32)
        assert torch.allclose(got_SH, want_SH, rtol=1e-5, atol=1e-5)


# ---- errors --------------------------------------------------------------------------------
@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("impl", [ref, ker], ids=["torch", "triton"])
def test_bad_inputs_raise(impl) -> None:
    tok = torch.zeros(3, 8)
    rows_PH = torch.zeros(4, 8)
    idx = torch.tensor([0, 1, -1, 2])
    with pytest.raises(ValueError, match="outside the 3 token rows"):
        impl.expand_rows(tok, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="1-D integer"):
        impl.expand_rows(tok, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="1-D integer"):
        impl.expand_rows(tok, idx.view(2, 2))
    with pytest.raises(ValueError, match=r"out must be torch\.float32 \[4, 8\]"):
        impl.expand_rows(tok, idx, torch.zeros(4, 7))
    with pytest.raises(ValueError, match="outside the 3 output rows"):
        impl.reduce_rows(rows_PH, torch.tensor([0, 3, 1, 1]), 3)
    with pytest.raises(ValueError, match="num_out"):
        impl.reduce_rows(rows_PH, idx, -1)
    with pytest.raises(ValueError, match=r"weight must be .* \[4\]"):
        impl.reduce_rows(rows_PH, idx, 3, torch.zeros(3))
    with pytest.raises(ValueError, match="rows must be one of"):
        impl.reduce_rows(rows_PH.half(), idx, 3)
    with pytest.raises(ValueError, match="out_dtype"):
        impl.reduce_rows(rows_PH, idx, 3, None, torch.float16)
    with pytest.raises(ValueError, match="segments are for 4 rows -> 3"):
        impl.reduce_rows(rows_PH, ref.segments(idx, 3), 4)
    with pytest.raises(ValueError, match="disagree"):
        impl.row_dot(rows_PH, torch.zeros(3, 9), idx)
    with pytest.raises(ValueError, match="b must be one of"):
        impl.row_dot(rows_PH, tok.bfloat16(), idx)
    with pytest.raises(ValueError, match="outside the 3 rows of b"):
        impl.row_dot(rows_PH, tok, torch.tensor([0, 1, 2, 3]))


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("impl", [ref, ker], ids=["torch", "triton"])
def test_check_false_skips_only_the_range_read(impl, monkeypatch: pytest.MonkeyPatch) -> None:
    """``check=False`` (rows already checked) gives the same bits and reads no range on
    the host; the default still does, and the shape checks stay on either way."""
    tokens_TH, rows_PH, idx_P, _ = _case(7, 40, 33, torch.float32, seed=5)
    want_PH, want_P = ref.expand_rows(tokens_TH, idx_P), ref.row_dot(rows_PH, tokens_TH, idx_P)
    reads: list[str] = []

    def counted(name: str, *args) -> None:  # type: ignore[no-untyped-def]
        reads.append(name)

    monkeypatch.setattr(ref, "check_below", counted)
    assert _same_bits(impl.expand_rows(tokens_TH, idx_P, check=False), want_PH)
    assert _same_bits(impl.row_dot(rows_PH, tokens_TH, idx_P, check=False), want_P)
    assert reads == []
    with pytest.raises(ValueError, match="disagree"):
        impl.row_dot(rows_PH, tokens_TH, idx_P[:-1], check=False)
    impl.expand_rows(tokens_TH, idx_P)
    impl.row_dot(rows_PH, tokens_TH, idx_P)
    assert reads == ["src_row", "idx"]


def test_kernels_need_the_interpreter_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ker.expand_rows(torch.zeros(2, 4), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ker.reduce_rows(torch.zeros(2, 4), torch.tensor([0, 1]), 2)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ker.row_dot(torch.zeros(2, 4), torch.zeros(2, 4), torch.tensor([0, 1]))


# (kernel, pointer and scalar argument types, constants) for an sm_90 compile
COMPILE_CASES = {
    "expand": ("*bf16 i64 *i64 *bf16 i64 i32 i32", {"BLOCK_P": 4, "BLOCK_H": 1024}),
    "reduce": ("*bf16 i64 *i64 *i64 *bf16 *fp32 i32", {"WEIGHTED": True, "BLOCK_H": 1024}),
    "dot": ("*bf16 i64 *bf16 i64 *i64 *fp32 i32 i32", dict(BLOCK_P=16, LANES=128, LOG2_LANES=7)),
}


@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_kernels_compile_for_cuda(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The compiled front end (not the interpreter) accepts each kernel: sm_90 code is
    built on the CPU, and the summing kernels contain no FMA."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(ker._kernels(False), name)
    types, consts = COMPILE_CASES[name]
    names = fn.arg_names
    sig = dict(zip(names, types.split() + ["constexpr"] * len(consts), strict=True))
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    options = {"enable_fp_fusion": False, "num_warps": 4}
    out = triton_mod.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert "cubin" in out.asm and "fma." not in out.asm["ptx"]


@pytest.mark.parametrize("name", ["expand", "reduce"])
def test_row_kernels_move_16_byte_vectors(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """At their default tiles the token-row copies load and store 16-byte vectors on sm_90
    (integer and pointer arguments specialised as multiples of 16, as for H = 7168)."""
    import re

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(ker._kernels(False), name)
    types, consts = COMPILE_CASES[name]
    assert consts["BLOCK_H"] == {"expand": ker.EXPAND, "reduce": ker.REDUCE}[name].cols
    names, n = fn.arg_names, len(types.split())
    sig = dict(zip(names, types.split() + ["constexpr"] * len(consts), strict=True))
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(n)}
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in consts.items()}, attrs)
    options = {"enable_fp_fusion": False, "num_warps": 4}
    ptx = triton_mod.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    got = set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= got, got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_reference(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Compiled kernels on CUDA tensors, top-8 sizes."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    T, P, H = 2048, 8 * 2048 + 96, 2048
    tokens_TH, rows_PH, idx_P, w_P = (t.cuda() for t in _case(T, P, H, dtype, seed=1))
    assert _same_bits(ker.expand_rows(tokens_TH, idx_P), ref.expand_rows(tokens_TH, idx_P))
    seg = ref.segments(idx_P, T)
    for w in (None, w_P):
        got = ker.reduce_rows(rows_PH, seg, T, w, dtype)
        assert _same_bits(got, ref.reduce_rows(rows_PH, seg, T, w, dtype))
    assert _same_bits(
        ker.row_dot(rows_PH, tokens_TH, idx_P), ref.row_dot(rows_PH, tokens_TH, idx_P)
    )
