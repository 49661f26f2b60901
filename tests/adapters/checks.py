"""Comparison helper shared by the adapter tests (no transformers needed)."""

from __future__ import annotations

import torch


def rel_close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5, what: str = "") -> None:
    """``|got - want| <= tol * |want| + 1e-6`` elementwise (fp32 results, fp64 comparison)."""
    torch.testing.assert_close(
        got.detach().double(),
        want.detach().double(),
        rtol=tol,
        atol=1e-6,
        msg=lambda m: f"{what}: {m}",
    )
