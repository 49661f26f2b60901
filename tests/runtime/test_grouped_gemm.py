"""The Triton grouped GEMM (``runtime/grouped_gemm.py``) against a float64 per-group product:
interpreted on CPU (random and adversarial groups, both weight orientations), its tile
schedule, and its sm_90 build (``wgmma`` in the PTX)."""

from __future__ import annotations

import pytest
import torch

from moonplan.runtime import grouped_gemm as gg
from tests.runtime.groups import random_group_sizes

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

SMALL = gg.GemmTiles(16, 16, 16, 1, 1)


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _reference(x_TK: torch.Tensor, w_GNK: torch.Tensor, ends_G: torch.Tensor) -> torch.Tensor:
    """float64 ``x[rows of g] @ w[g].T``, zero outside every group."""
    y = torch.zeros(x_TK.shape[0], w_GNK.shape[1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(ends_G.tolist()):
        y[start:end] = x_TK[start:end].double() @ w_GNK[g].double().T
        start = end
    return y


def _case(T: int, K: int, N: int, sizes: list[int], dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    w = (torch.randn(len(sizes), N, K, generator=g) * K**-0.5).to(dtype)
    ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    return x, w, ends


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp(min=1e-30))


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("T", "K", "N", "sizes"),
    [
        (40, 24, 20, [7, 0, 16, 9]),  # an empty group, partial tiles, 8 rows outside
        (33, 16, 16, [33]),  # one group, every row
        (20, 37, 5, [0, 0, 3]),  # leading empty groups, K and N off the tile
        (9, 8, 8, [0, 0]),  # no row in any group: all zero
    ],
)
def test_matches_float64(T: int, K: int, N: int, sizes: list[int], dtype: torch.dtype) -> None:
    x, w, ends = _case(T, K, N, sizes, dtype, seed=T + K)
    want = _reference(x, w, ends)
    got = gg.grouped_mm(x, w, ends, tiles=SMALL)
    assert got.dtype == dtype and got.shape == (T, N)
    assert torch.count_nonzero(got[int(ends[-1]) :]) == 0
    assert _rel(got, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    # the input-gradient orientation: y = x @ w[g] through a transposed view
    w_T = w.transpose(1, 2).contiguous()  # [G, K, N] stored; its transpose is [G, N, K]
    got_t = gg.grouped_mm(x, w_T.transpose(1, 2), ends, tiles=SMALL)
    assert _rel(got_t, want) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.usefixtures("interpret")
def test_default_tiles_in_the_interpreter() -> None:
    x, w, ends = _case(150, 64, 130, [60, 90], torch.float32, seed=3)
    assert _rel(gg.grouped_mm(x, w, ends), _reference(x, w, ends)) < 1e-6


def test_tile_schedule_covers_every_tile_once() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        sizes = random_group_sizes(gen, max_groups=8, max_rows=39, empty_share=0.3)
        G = len(sizes)
        T = int(sizes.sum()) + int(torch.randint(0, 5, (1,), generator=gen))
        block = int(torch.randint(1, 17, (1,), generator=gen))
        group_M, first_G, m_tiles = gg._tile_groups(sizes.cumsum(0), block, T)
        want = (sizes + block - 1) // block
        assert group_M.numel() == m_tiles >= int(want.sum())
        for g in range(G):
            mine = (group_M == g).nonzero().flatten()
            assert mine.numel() == int(want[g])
            if mine.numel():
                assert mine.tolist() == list(range(int(first_G[g]), int(first_G[g]) + mine.numel()))
        assert bool((group_M[int(want.sum()) :] == -1).all())


def test_bad_inputs_raise() -> None:
    x, w, ends = _case(8, 8, 8, [8], torch.float32, seed=0)
    with pytest.raises(ValueError, match="must be"):
        gg.grouped_mm(x, w[:, :, :4], ends)
    with pytest.raises(ValueError, match="float64"):
        gg.grouped_mm(x.double(), w.double(), ends)
    with pytest.raises(ValueError, match="integers"):
        gg.grouped_mm(x, w, ends.float())


def test_sm90_build_uses_wgmma(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled for sm_90 on the CPU at the default tile, bf16: Hopper's warpgroup MMA."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = gg._kernels(False).mm
    t = gg.DEFAULT
    types = ["*bf16"] * 3 + ["*i64"] * 3 + ["i32"] * 2 + ["i64"] * 6 + ["i32"]
    consts = {"BLOCK_M": t.m, "BLOCK_N": t.n, "BLOCK_K": t.k, "WIDEN": False}
    names = fn.arg_names
    sig = dict(zip(names, types + ["constexpr"] * len(consts), strict=True))
    one = {"sx_k", "sw_k"}  # unit strides along K: what Triton specialises for contiguous x, w
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names[: len(types)])}
    for n in one:
        attrs.pop((names.index(n),))
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in consts.items()}, attrs)
    options = {"num_warps": t.warps, "num_stages": t.stages}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    assert "wgmma" in ptx


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tiles", gg.CANDIDATES)
def test_cuda_matches_grouped_mm(monkeypatch: pytest.MonkeyPatch, tiles: gg.GemmTiles) -> None:
    """Compiled on the GPU, every benchmarked tile against torch._grouped_mm (bf16)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w, ends = _case(1000, 256, 384, [300, 0, 128, 500], torch.bfloat16, seed=9)
    x, w, ends = x.cuda(), w.cuda(), ends.cuda()
    got = gg.grouped_mm(x, w, ends, tiles=tiles)
    want = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)[: int(ends[-1])]
    assert _rel(got[: int(ends[-1])].cpu(), want.double().cpu()) < 1e-2
    assert torch.count_nonzero(got[int(ends[-1]) :]) == 0
