"""Comparison helper shared by the adapter tests (no transformers needed)."""

from __future__ import annotations

import torch


def rel_close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5, what: str = "") -> None:
    """``|got - want| <= tol * (|want| + max|want|)`` elementwise (fp32 results, fp64 comparison).

    The absolute part scales with the tensor's largest entry: fp32 sums taken in another
    order (another rank split, another BLAS kernel on another CPU) differ by a few ulps of
    the largest term, which is far more than ``tol * |want|`` for an entry that cancels to
    nearly zero.
    """
    want64 = want.detach().double()
    scale = float(want64.abs().max()) if want64.numel() else 0.0
    torch.testing.assert_close(
        got.detach().double(),
        want64,
        rtol=tol,
        atol=tol * scale + 1e-12,
        msg=lambda m: f"{what}: {m}",
    )


def inputs(sizes: list[int], width: int, seed: int = 7) -> tuple[list, list]:
    """Every rank's ``x [2, S_r, width]`` and output cotangent ``c`` of the same shape."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, s, width, generator=g) for s in sizes]
    cs = [torch.randn(2, s, width, generator=g) for s in sizes]
    return xs, cs


def grads(m: torch.nn.Module) -> dict:
    """Every parameter's gradient (zeros where it got none), by name."""
    return {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in m.named_parameters()
    }


def forward_backward(
    wrapped: torch.nn.Module, ref: torch.nn.Module, x: torch.Tensor, c: torch.Tensor
) -> dict:
    """``(y * c).sum()`` backward through ``wrapped`` and through ``ref``, each on its own copy
    of ``x``: outputs ``y``/``y0``, input gradients ``dx``/``dx0``, parameter gradients
    ``grads``/``grads0``, the wrapped parameters' ``shapes`` and its ``home`` experts."""
    x1 = x.clone().requires_grad_(True)
    x0 = x.clone().requires_grad_(True)
    y = wrapped(x1)
    (y * c).sum().backward()
    y0 = ref(x0)
    if y0.requires_grad:  # an original block on no tokens builds no graph
        (y0 * c).sum().backward()
    return {
        "y": y.detach(),
        "y0": y0.detach(),
        "dx": x1.grad,
        "dx0": x0.grad if x0.grad is not None else torch.zeros_like(x0),
        "grads": grads(wrapped),
        "grads0": grads(ref),
        "shapes": {n: tuple(p.shape) for n, p in wrapped.named_parameters()},
        "home": wrapped.get_buffer("home_experts").tolist(),
    }
