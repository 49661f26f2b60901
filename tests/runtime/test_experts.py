"""``grouped_swiglu`` against the per-group loop ``swiglu_reference``: values and gradients.

Legend: T rows, H hidden, F FFN size, G groups, ``offsets_G1`` cumulative row offsets.
"""

from __future__ import annotations

import pytest
import torch

from moonplan.runtime.experts import GroupedMMError, grouped_swiglu, swiglu_reference
from tests.runtime.groups import random_group_sizes

DTYPES = [torch.float32, torch.bfloat16]


def _inputs(
    sizes: list[int], H: int, F: int, dtype: torch.dtype, pad: int = 0, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Rows for groups of ``sizes`` (+ ``pad`` trailing rows), offsets and weights."""
    gen = torch.Generator().manual_seed(seed)
    G, T = len(sizes), sum(sizes) + pad
    offsets_G1 = torch.tensor([0, *torch.tensor(sizes, dtype=torch.int64).cumsum(0).tolist()])
    x_TH = torch.randn(T, H, generator=gen).to(dtype)
    gate_up = (torch.randn(G, 2 * F, H, generator=gen) / H**0.5).to(dtype)
    down = (torch.randn(G, H, F, generator=gen) / F**0.5).to(dtype)
    return x_TH, offsets_G1, gate_up, down


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference over the max magnitude of ``b`` (0 for empty tensors)."""
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def _tol(dtype: torch.dtype) -> float:
    """fp32: 1e-5; bf16: a few units of bf16 rounding (2**-8 relative)."""
    return 1e-5 if dtype == torch.float32 else 2e-2


def _grads(fn, args: tuple[torch.Tensor, ...], dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, offsets, gate_up, down = (a.detach().clone() for a in args)
    leaves = [t.requires_grad_() for t in (x, gate_up, down)]
    y = fn(x, offsets, gate_up, down)
    return (y.detach(), *torch.autograd.grad(y, leaves, dy))


CASES = {
    "random": ([37, 5, 60, 1, 22], 0),
    "empty_groups": ([0, 17, 0, 0, 9, 0], 0),
    "padding_rows": ([4, 8, 0, 3], 11),
    "one_group": ([64], 0),
    "first_and_last_empty": ([0, 1, 2, 0], 3),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_grads_match_reference(case: str, dtype: torch.dtype) -> None:
    sizes, pad = CASES[case]
    args = _inputs(sizes, H=32, F=24, dtype=dtype, pad=pad)
    dy = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = _grads(grouped_swiglu, args, dy)
    want = _grads(swiglu_reference, args, dy)
    for name, g, w in zip(("y", "dx", "dgate_up", "ddown"), got, want, strict=True):
        assert g.dtype == w.dtype == dtype and g.shape == w.shape, name
        assert _rel(g, w) <= _tol(dtype), (name, _rel(g, w))
    T_used = int(args[1][-1])
    assert torch.all(got[0][T_used:] == 0) and torch.all(got[1][T_used:] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_groups_have_zero_weight_grads(dtype: torch.dtype) -> None:
    args = _inputs([0, 5, 0], H=16, F=8, dtype=dtype, pad=4)
    _, _, dgu, ddown = _grads(grouped_swiglu, args, torch.ones(9, 16, dtype=dtype))
    for g in (0, 2):
        assert torch.all(dgu[g] == 0) and torch.all(ddown[g] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("sizes", "pad"), [([0, 0, 0], 5), ([], 6), ([0, 0], 0), ([], 0)])
def test_degenerate(sizes: list[int], pad: int, dtype: torch.dtype) -> None:
    """All groups empty, ``G == 0``, ``T == 0``: zeros, and zero (not missing) gradients."""
    args = _inputs(sizes, H=16, F=8, dtype=dtype, pad=pad)
    y, dx, dgu, ddown = _grads(grouped_swiglu, args, torch.ones(pad, 16, dtype=dtype))
    assert y.shape == (pad, 16) and torch.all(y == 0) and torch.all(dx == 0)
    assert dgu.shape == args[2].shape and torch.all(dgu == 0) and torch.all(ddown == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("H", "F"), [(7, 5), (12, 6), (30, 3)])
def test_unaligned_sizes_are_padded(H: int, F: int, dtype: torch.dtype) -> None:
    args = _inputs([3, 0, 6], H=H, F=F, dtype=dtype, pad=2)
    dy = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = _grads(grouped_swiglu, args, dy)
    want = _grads(swiglu_reference, args, dy)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and _rel(g, w) <= _tol(dtype)


def test_adversarial_random_groups() -> None:
    """Many random group-size patterns (fp32, forward), incl. long runs of empty groups."""
    gen = torch.Generator().manual_seed(3)
    for seed in range(20):
        sizes = random_group_sizes(gen, max_groups=11, max_rows=8, empty_share=0.4)
        pad = int(torch.randint(0, 4, (1,), generator=gen))
        args = _inputs(sizes.tolist(), H=8, F=4, dtype=torch.float32, pad=pad, seed=seed)
        assert _rel(grouped_swiglu(*args), swiglu_reference(*args)) <= 1e-5


def test_non_contiguous_inputs() -> None:
    x, offsets, gate_up, down = _inputs([5, 3], H=16, F=8, dtype=torch.float32)
    x_t = x.t().contiguous().t()
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)
    want = swiglu_reference(x, offsets, gate_up, down)
    assert _rel(grouped_swiglu(x_t, offsets, gate_up, down_t), want) <= 1e-5


@pytest.mark.parametrize(
    ("offsets", "match"),
    [([1, 3, 5], "offsets\\[0\\]"), ([0, 4, 2], "non-decreasing"), ([0, 3, 99], "exceeds")],
)
def test_bad_offsets_raise(offsets: list[int], match: str) -> None:
    x, _, gate_up, down = _inputs([3, 2], H=8, F=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        grouped_swiglu(x, torch.tensor(offsets), gate_up, down)
    with pytest.raises(ValueError, match=match):
        swiglu_reference(x, torch.tensor(offsets), gate_up, down)
    good = torch.tensor([0, 3, 5])  # the host copy is what is checked, not read back
    with pytest.raises(ValueError, match=match):
        grouped_swiglu(x, good, gate_up, down, bounds=offsets)


def test_host_bounds_check_without_a_read() -> None:
    """``bounds`` (the offsets as host integers): the same result, no host read, and a
    copy of the wrong length is refused."""
    from tests.plan.host_work import host_work

    x, offsets, gate_up, down = _inputs([3, 2], H=8, F=4, dtype=torch.float32)
    want = grouped_swiglu(x, offsets, gate_up, down)
    got = []
    work = host_work(
        lambda: got.append(grouped_swiglu(x, offsets, gate_up, down, bounds=[0, 3, 5]))
    )
    assert torch.equal(got[0], want) and work.host_reads == 0, work.reads
    assert host_work(lambda: grouped_swiglu(x, offsets, gate_up, down)).host_reads == 1
    with pytest.raises(ValueError, match="bounds"):
        grouped_swiglu(x, offsets, gate_up, down, bounds=[0, 5])


def test_bad_shapes_and_dtypes_raise() -> None:
    x, offsets, gate_up, down = _inputs([3, 2], H=8, F=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="G\\+1"):
        grouped_swiglu(x, offsets[:-1], gate_up, down)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_swiglu(x[:, :4], offsets, gate_up, down)
    with pytest.raises(ValueError, match="share a dtype"):
        grouped_swiglu(x.bfloat16(), offsets, gate_up, down)
    with pytest.raises(ValueError, match="integers"):
        grouped_swiglu(x, offsets.float(), gate_up, down)


def test_rejected_dtype_raises_grouped_mm_error() -> None:
    """fp64 is not supported by ``torch._grouped_mm``: a clear error, no silent fallback."""
    args = _inputs([3, 2], H=8, F=4, dtype=torch.float64)
    with pytest.raises(GroupedMMError, match="float64"):
        grouped_swiglu(*args)
    assert swiglu_reference(*args).dtype == torch.float64
