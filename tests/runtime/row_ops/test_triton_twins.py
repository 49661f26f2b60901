"""Triton row ops (``row_ops/triton.py``) against their torch twins, bit for bit.

On CPU they run under the Triton interpreter: Triton 3.9 reads ``TRITON_INTERPRET``
when a kernel is decorated (not when triton is imported), and ``kernels`` decorates
its kernels on first use, once per mode, so setting the variable per test suffices.

Legend: R ranks, S tokens, K top-k, N = S*K records, H hidden, ``cap_r`` view rows.
"""

from __future__ import annotations

import pytest
import torch

import moonplan
from moonplan.runtime.row_ops import torch as rows
from moonplan.runtime.row_ops import triton as kernels

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits, except that any NaN equals any NaN (payloads differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    same = a.view(ints) == b.view(ints)
    return bool(torch.equal(nan_a, nan_b) and torch.all(same | nan_a))


def _views(caps: list[int], H: int, dtype: torch.dtype, gen: torch.Generator, pad: int = 0):
    """Separate tensors per rank (random contents), ``[cap_r, H]`` views with row stride H+pad."""
    return [torch.randn(c, H + pad, generator=gen).to(dtype)[:, :H] for c in caps]


def _records(
    S: int, K: int, caps: list[int], gen: torch.Generator, dup: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[S, K]`` ranks (never the empty-capacity ones; some tokens send all K records
    to one rank) and distinct rows per rank."""
    live = torch.tensor([r for r, c in enumerate(caps) if c > 0])
    rank_SK = live[torch.randint(0, live.numel(), (S, K), generator=gen)]
    if dup and S:
        same_S = torch.rand(S, generator=gen) < 0.3
        rank_SK[same_S] = rank_SK[same_S, :1]
    off_SK = torch.empty_like(rank_SK)
    for r, cap in enumerate(caps):
        m = rank_SK == r
        assert int(m.sum()) <= cap
        off_SK[m] = torch.randperm(cap, generator=gen)[: int(m.sum())]
    return rank_SK, off_SK


def _caps(S: int, K: int) -> list[int]:
    """Four ranks: one empty (0 rows), one exactly big enough for everything, two roomy."""
    return [S * K + 3, 0, S * K, S * K + 7]


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize(("S", "H", "pad"), [(11, 50, 0), (5, 130, 3)])
def test_scatter_matches_twin(S: int, H: int, pad: int, K: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(S * 100 + K)
    caps = _caps(S, K)
    x_SH = torch.randn(S, H, generator=gen).to(dtype)
    rank_SK, off_SK = _records(S, K, caps, gen)
    got = _views(caps, H, dtype, gen, pad)
    want = [v.clone() for v in got]  # untouched rows must stay as they were
    kernels.scatter_rows(x_SH, rank_SK.reshape(-1), off_SK.reshape(-1), K, got)
    rows.scatter_rows(x_SH, rank_SK.reshape(-1), off_SK.reshape(-1), K, want)
    assert all(_same_bits(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_shape", [(3, 37), (2, 600), (5,)])
def test_gather_rows_matches_twin(row_shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(len(row_shape))
    caps = [4, 0, 3, 6]
    src = [torch.randn(c, *row_shape, generator=gen).to(dtype) for c in caps]
    n = 9
    live = torch.tensor([0, 2, 3])
    rank_n = live[torch.randint(0, 3, (n,), generator=gen)]
    row_n = torch.tensor([int(torch.randint(0, caps[r], (1,), generator=gen)) for r in rank_n])
    got = torch.randn(n, *row_shape, generator=gen).to(dtype)
    want = got.clone()
    kernels.gather_rows(src, rank_n, row_n, got)
    rows.gather_rows(src, rank_n, row_n, want)
    assert _same_bits(got, want)


@pytest.mark.usefixtures("interpret")
def test_routes_of_a_real_plan() -> None:
    """Every rank's records of a skewed plan (align 4) land where the twin puts them."""
    gen = torch.Generator().manual_seed(11)
    R, E, S, K, H = 3, 7, 9, 3, 20
    pop_E = torch.tensor([20.0, 1, 1, 5, 1, 1, 1])
    ids = [torch.multinomial(pop_E, S * K, True, generator=gen).view(S, K) for _ in range(R)]
    counts_RE = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
    plan = moonplan.plan(counts_RE, align=4)
    caps = plan.recv_size().tolist()
    got = [torch.zeros(c, H, dtype=torch.bfloat16) for c in caps]
    want = [v.clone() for v in got]
    for r in range(R):
        route = moonplan.route(plan, r, ids[r])
        x_SH = torch.randn(S, H, generator=gen).to(torch.bfloat16)
        args = (route.dest_rank.reshape(-1), route.dest_offset.reshape(-1), K)
        kernels.scatter_rows(x_SH, *args, got)
        rows.scatter_rows(x_SH, *args, want)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    route = moonplan.route(plan, 1, ids[1])
    back = torch.empty(S * K, H, dtype=torch.bfloat16)
    kernels.gather_rows(got, route.dest_rank.reshape(-1), route.dest_offset.reshape(-1), back)
    twin = torch.empty_like(back)
    rows.gather_rows(want, route.dest_rank.reshape(-1), route.dest_offset.reshape(-1), twin)
    assert torch.equal(back, twin)


def test_tiles_and_the_alignment_check() -> None:
    assert kernels.Blocks().tile(7168) == (4, 1024) and kernels.Blocks().tile(50) == (4, 64)
    assert kernels.Blocks(rows=2, cols=256).tile(3) == (2, 16)
    whole = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert kernels._aligned([whole, whole.clone()], 64)
    assert not kernels._aligned([whole.view(-1)[1:].view(-1)[:128].view(2, 64)], 64)  # 2 bytes off
    assert not kernels._aligned([whole], 60)  # rows 120 bytes apart
    assert not kernels._aligned([], 64)


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("blocks", [kernels.Blocks(1, 16, 1), kernels.Blocks(8, 32, 2)])
@pytest.mark.parametrize("misaligned", [False, True])
def test_other_tiles_and_misaligned_views_match_twin(blocks, misaligned: bool) -> None:
    """Any tile gives the twin's bits; so do views that start 2 bytes off (no hint then)."""
    gen = torch.Generator().manual_seed(3)
    S, K, H, dtype = 7, 3, 40, torch.bfloat16
    caps = _caps(S, K)
    start = 1 if misaligned else 0
    base = [torch.randn(c * H + start, generator=gen).to(dtype) for c in caps]
    got = [b[start:].view(c, H) for b, c in zip(base, caps, strict=True)]
    assert kernels._aligned([g for g in got if g.numel()], H) == (not misaligned)
    want = [v.clone() for v in got]
    x_SH = torch.randn(S, H, generator=gen).to(dtype)
    rank_SK, off_SK = _records(S, K, caps, gen)
    args = (rank_SK.reshape(-1), off_SK.reshape(-1), K)
    kernels.scatter_rows(x_SH, *args, got, blocks=blocks)
    rows.scatter_rows(x_SH, *args, want)
    assert all(_same_bits(g, w) for g, w in zip(got, want, strict=True))
    back, twin = torch.empty(S * K, H, dtype=dtype), torch.empty(S * K, H, dtype=dtype)
    kernels.gather_rows(got, rank_SK.reshape(-1), off_SK.reshape(-1), back, blocks=blocks)
    rows.gather_rows(want, rank_SK.reshape(-1), off_SK.reshape(-1), twin)
    assert _same_bits(back, twin)


SCATTER_SIG = "*bf16 i64 *i64 *i64 *i64 i64 i32 i32"
GATHER_SIG = "*i64 *i64 *i64 i64 *bf16 i64 i32 i32"


def _sm90_accesses(name: str, types: str, consts: dict) -> set[str]:
    """The global loads and stores of kernel ``name`` compiled for sm_90 on the CPU, its
    integer and pointer arguments specialised as multiples of 16 (as Triton does for a
    row length of 7168 and 256-byte aligned buffers)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(kernels._kernels(False), name)
    names = fn.arg_names
    types_ = types.split()
    sig = dict(zip(names, types_ + ["constexpr"] * len(consts), strict=True))
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(types_))}
    src = ASTSource(
        fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs
    )
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    return set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))


@pytest.mark.parametrize("aligned", [True, False])
def test_aligned_kernels_move_16_byte_vectors(
    monkeypatch: pytest.MonkeyPatch, aligned: bool
) -> None:
    """With the launcher's alignment hint the peer stores (scatter) and peer loads (gather)
    are 16-byte vectors in the sm_90 PTX; without it they are 2-byte bf16 accesses."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tile = {"BLOCK_N": 4, "ALIGNED": aligned}
    scatter = _sm90_accesses("scatter", SCATTER_SIG, {"TOP_K": 8, **tile, "BLOCK_H": 1024})
    gather = _sm90_accesses("gather", GATHER_SIG, {**tile, "BLOCK_L": 1024})
    assert "ld.global.v4.b32" in scatter and "st.global.v4.b32" in gather  # own rows: aligned
    assert ("st.global.v4.b32" in scatter) == aligned and ("st.global.b16" in scatter) != aligned
    assert ("ld.global.b16" in gather) != aligned


@pytest.mark.usefixtures("interpret")
def test_empty_inputs() -> None:
    views = [torch.zeros(3, 8), torch.zeros(0, 8)]
    none = torch.zeros(0, dtype=torch.int64)
    kernels.scatter_rows(torch.zeros(0, 8), none, none, 2, views)
    kernels.gather_rows(views, none, none, torch.zeros(0, 8))
    assert torch.equal(views[0], torch.zeros(3, 8))


@pytest.mark.usefixtures("interpret")
def test_bad_inputs_raise() -> None:
    views = [torch.zeros(3, 8), torch.zeros(2, 8)]
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="outside"):
        kernels.scatter_rows(x, torch.tensor([0, 1]), torch.tensor([0, 2]), 1, views)
    with pytest.raises(ValueError, match="ranks must lie"):
        kernels.scatter_rows(x, torch.tensor([0, 2]), torch.tensor([0, 0]), 1, views)
    with pytest.raises(ValueError, match="elements"):
        kernels.scatter_rows(x, torch.tensor([0, 1]), torch.tensor([0, 0]), 2, views)
    with pytest.raises(ValueError, match=r"expected torch\.float32"):
        kernels.scatter_rows(x, torch.tensor([0]), torch.tensor([0]), 1, [views[0].bfloat16()])
    odd = [torch.zeros(3, 8), torch.zeros(3, 10)[:, :8]]
    with pytest.raises(ValueError, match="row stride"):
        kernels.scatter_rows(x, torch.tensor([0, 1]), torch.tensor([0, 1]), 1, odd)
    with pytest.raises(ValueError, match="outside"):
        kernels.gather_rows(views, torch.tensor([1]), torch.tensor([-1]), torch.zeros(1, 8))


def test_available_reports_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.available("cpu")[0]
    assert not kernels.available("cuda")[0]
    monkeypatch.delenv("TRITON_INTERPRET")
    ok, why = kernels.available("cpu")
    assert not ok and "TRITON_INTERPRET" in why
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.scatter_rows(
            torch.zeros(1, 4), torch.tensor([0]), torch.tensor([0]), 1, [torch.zeros(1, 4)]
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_twin(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Compiled kernels on CUDA tensors (peer table of separate allocations)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(5)
    S, K, H = 300, 4, 1000
    caps = _caps(S, K)
    rank_SK, off_SK = _records(S, K, caps, gen)
    x_SH = torch.randn(S, H, generator=gen).to(dtype).cuda()
    got = [v.cuda() for v in _views(caps, H, dtype, gen, pad=8)]
    want = [v.clone() for v in got]
    kernels.scatter_rows(x_SH, rank_SK.reshape(-1).cuda(), off_SK.reshape(-1).cuda(), K, got)
    rows.scatter_rows(x_SH, rank_SK.reshape(-1).cuda(), off_SK.reshape(-1).cuda(), K, want)
    assert all(_same_bits(g, w) for g, w in zip(got, want, strict=True))
    dst_a = torch.empty(S, H, dtype=dtype, device="cuda")
    dst_b = dst_a.clone()
    kernels.gather_rows(got, rank_SK[:, 0].cuda(), off_SK[:, 0].cuda(), dst_a)
    rows.gather_rows(got, rank_SK[:, 0].cuda(), off_SK[:, 0].cuda(), dst_b)
    assert _same_bits(dst_a, dst_b)
