"""Dense single-process oracle for MoE layers and shared test set-up.

Legend: T tokens (all ranks), H hidden, F ffn, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_


def dense_weights(E: int, H: int, F: int, seed: int, dtype: torch.dtype = torch.float32) -> dict:
    """Router ``[E, H]``, ``gate_up [E, 2F, H]``, ``down [E, H, F]`` from a seed."""
    g = torch.Generator().manual_seed(seed)
    return {
        "router_weight": (torch.randn(E, H, generator=g) * H**-0.5).to(dtype),
        "gate_up": (torch.randn(E, 2 * F, H, generator=g) * H**-0.5).to(dtype),
        "down": (torch.randn(E, H, F, generator=g) * F**-0.5).to(dtype),
    }


def tokens(T: int, H: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)


def split(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(x, sizes))


def dense_moe(
    x_TH: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, w: dict
) -> torch.Tensor:
    """``y[t] = sum_k w[t,k] * SwiGLU_{ids[t,k]}(x[t])`` with plain per-token matmuls (fp64)."""
    F = w["down"].shape[2]
    y = torch.zeros(x_TH.shape, dtype=torch.float64)
    for t in range(x_TH.shape[0]):
        for k in range(ids_TK.shape[1]):
            e = int(ids_TK[t, k])
            gu = w["gate_up"][e].double() @ x_TH[t].double()
            h = F_.silu(gu[:F]) * gu[F:]
            y[t] += float(w_TK[t, k]) * (w["down"][e].double() @ h)
    return y
