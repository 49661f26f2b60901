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
