"""SwiGLU experts over expert-grouped rows (one rank's grouped-GEMM input).

Legend:
    T rows (records plus padding), H hidden size, F expert FFN size, G groups (weight rows)
    ``offsets_G1 [G+1]``: cumulative row offsets (cu_seqlens, ``offsets[0] == 0``); group
    ``g`` owns rows ``[offsets[g], offsets[g+1])``; rows from ``offsets[G]`` on belong to
    no group and give ``y = 0``.
    ``gate_up_G2FH [G, 2F, H]`` (gate rows first) and ``down_GHF [G, H, F]``: the
    transformers layout; ``y = (silu(x @ gate.T) * (x @ up.T)) @ down.T`` per group.

:func:`swiglu_reference` is the readable spec (a loop over groups);
:func:`grouped_swiglu` computes the same with two ``torch._grouped_mm`` calls and
its own autograd (also grouped mm).

``torch._grouped_mm`` (torch 2.13), as measured on CPU:

* accepts fp32, bf16 and fp16 on CPU (not fp64); mixed dtypes are rejected and the
  output dtype must equal the input dtype (fp32 accumulate for bf16, bf16 output);
* ``offs`` must be int32 and holds the cumulative **ends** of the groups; it is not
  validated (decreasing or too large offsets are accepted and read out of bounds);
* output rows past ``offs[-1]`` are left **uninitialised** (garbage, even NaN), also
  in its built-in backward's input gradient, so both are masked here;
* empty groups give zero weight gradients; ``G == 0`` and ``T == 0`` work;
* every operand's non-unit stride must be a multiple of 16 bytes (``H`` and ``F``
  multiples of 4 in fp32, of 8 in bf16); other sizes are zero-padded here (exact,
  but a copy of the weights per call).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F_

_ALIGN_BYTES = 16


class GroupedMMError(RuntimeError):
    """``torch._grouped_mm`` is missing, or rejected these inputs (dtype, device)."""


# ---- the spec ----------------------------------------------------------------------------
def swiglu_reference(
    x_TH: torch.Tensor,
    offsets_G1: torch.Tensor,
    gate_up_G2FH: torch.Tensor,
    down_GHF: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU of each group's rows with that group's weights, one group at a time.

    Args:
        x_TH: ``[T, H]`` rows, fp32/bf16/fp16.
        offsets_G1: ``[G+1]`` integer cumulative row offsets (see legend).
        gate_up_G2FH: ``[G, 2F, H]``, dtype of ``x``.
        down_GHF: ``[G, H, F]``, dtype of ``x``.

    Returns:
        ``[T, H]`` in ``x``'s dtype (torch matmul semantics: bf16 accumulates in fp32
        and rounds each product matrix to bf16); rows outside every group are 0.
        Differentiable.
    """
    _check(x_TH, offsets_G1, gate_up_G2FH, down_GHF)
    F = gate_up_G2FH.shape[1] // 2
    bounds = [int(v) for v in offsets_G1.tolist()]
    parts = []
    for g in range(len(bounds) - 1):
        xg = x_TH[bounds[g] : bounds[g + 1]]
        gate = xg @ gate_up_G2FH[g, :F].T
        up = xg @ gate_up_G2FH[g, F:].T
        parts.append((F_.silu(gate) * up) @ down_GHF[g].T)
    tail = x_TH.shape[0] - bounds[-1]
    parts.append(x_TH.new_zeros(tail, x_TH.shape[1]))
    return torch.cat(parts)


# ---- the fast path ------------------------------------------------------------------------
def grouped_swiglu(
    x_TH: torch.Tensor,
    offsets_G1: torch.Tensor,
    gate_up_G2FH: torch.Tensor,
    down_GHF: torch.Tensor,
    *,
    check: bool = True,
    bounds: Sequence[int] | None = None,
) -> torch.Tensor:
    """:func:`swiglu_reference` with ``torch._grouped_mm`` (same shapes, dtypes, result).

    Args:
        x_TH, offsets_G1, gate_up_G2FH, down_GHF: as in :func:`swiglu_reference`.
        check: validate the offsets' values (reads them on the host, unless ``bounds``
            are given; turn off for CUDA-graph capture once they are known to be valid).
            Shapes and dtypes are always checked.
        bounds: ``offsets_G1``'s values as ``G + 1`` host integers, where the caller
            already holds them: ``check`` validates these instead (no host read).

    Returns:
        ``[T, H]`` in ``x``'s dtype, 0 on rows outside every group; differentiable
        in ``x``, ``gate_up`` and ``down`` (the backward also uses grouped mm).

    Raises:
        ValueError: bad shapes, dtypes or offsets.
        GroupedMMError: ``torch._grouped_mm`` is missing or rejects the dtype/device.
    """
    _check(x_TH, offsets_G1, gate_up_G2FH, down_GHF, values=check, bounds=bounds)
    if not hasattr(torch, "_grouped_mm"):
        raise GroupedMMError(f"torch {torch.__version__} has no torch._grouped_mm")
    T, H = x_TH.shape
    F = gate_up_G2FH.shape[1] // 2
    x_TH, gate_up_G2FH, down_GHF = _pad_aligned(x_TH, gate_up_G2FH, down_GHF)
    Fp = gate_up_G2FH.shape[1] // 2
    ends_G = offsets_G1[1:].to(device=x_TH.device, dtype=torch.int32)
    outside_T1 = (torch.arange(T, device=x_TH.device) >= offsets_G1[-1].to(x_TH.device))[:, None]
    try:
        gu_T2F = _GroupedLinear.apply(x_TH, gate_up_G2FH, ends_G, outside_T1)
        h_TF = F_.silu(gu_T2F[:, :Fp]) * gu_T2F[:, Fp:]
        y_TH = _GroupedLinear.apply(h_TF, down_GHF, ends_G, outside_T1)
    except RuntimeError as err:
        if isinstance(err, GroupedMMError):
            raise
        raise GroupedMMError(
            f"torch._grouped_mm rejected x {x_TH.dtype} on {x_TH.device} "
            f"(T={T}, H={H}, F={F}, G={ends_G.numel()}): {err}"
        ) from err
    return y_TH[:, :H]


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of g] = x[rows of g] @ w[g].T``; ``y = 0`` on rows outside every group."""

    @staticmethod
    def forward(
        ctx: Any,
        x_TK: torch.Tensor,
        w_GNK: torch.Tensor,
        ends_G: torch.Tensor,
        outside_T1: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(x_TK, w_GNK, ends_G, outside_T1)
        y_TN = torch._grouped_mm(x_TK, w_GNK.transpose(-2, -1), offs=ends_G)
        return y_TN.masked_fill_(outside_T1, 0)  # those rows are left uninitialised

    @staticmethod
    def backward(ctx: Any, dy_TN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_TK, w_GNK, ends_G, outside_T1 = ctx.saved_tensors
        dy_TN = dy_TN.contiguous()
        dx_TK = dw_GNK = None
        if ctx.needs_input_grad[0]:
            dx_TK = torch._grouped_mm(dy_TN, w_GNK, offs=ends_G).masked_fill_(outside_T1, 0)
        if ctx.needs_input_grad[1]:
            # 2-D x 2-D: the row dimension is split by `ends`; rows past the end are ignored.
            dw_GNK = torch._grouped_mm(dy_TN.t(), x_TK, offs=ends_G)
        return dx_TK, dw_GNK, None, None


def _aligned(n: int, dtype: torch.dtype) -> int:
    """``n`` rounded up so that ``n`` elements of ``dtype`` span a multiple of 16 bytes."""
    step = max(1, _ALIGN_BYTES // dtype.itemsize)
    return -(-n // step) * step


def _pad_aligned(
    x_TH: torch.Tensor, gate_up_G2FH: torch.Tensor, down_GHF: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-pad ``H`` and ``F`` to grouped-mm stride alignment (no-op when aligned).

    Zero columns add exact zeros to every dot product, and padded FFN units give
    ``silu(0) * 0 = 0``, so the first ``H`` output columns are unchanged.
    """
    H, F = x_TH.shape[1], gate_up_G2FH.shape[1] // 2
    Hp, Fp = _aligned(H, x_TH.dtype), _aligned(F, x_TH.dtype)
    x_TH = x_TH.contiguous()
    if (Hp, Fp) == (H, F):
        return x_TH, gate_up_G2FH.contiguous(), down_GHF.contiguous()
    gate, up = gate_up_G2FH[:, :F], gate_up_G2FH[:, F:]
    pad_gu = (0, Hp - H, 0, Fp - F)
    gate_up_G2FH = torch.cat([F_.pad(gate, pad_gu), F_.pad(up, pad_gu)], dim=1)
    return F_.pad(x_TH, (0, Hp - H)), gate_up_G2FH, F_.pad(down_GHF, (0, Fp - F, 0, Hp - H))


# ---- validation --------------------------------------------------------------------------
def _check(
    x_TH: torch.Tensor,
    offsets_G1: torch.Tensor,
    gate_up_G2FH: torch.Tensor,
    down_GHF: torch.Tensor,
    *,
    values: bool = True,
    bounds: Sequence[int] | None = None,
) -> None:
    """Raise ``ValueError`` on inconsistent shapes/dtypes (and, with ``values``, offsets:
    ``bounds``, their host copy, where given, else read from ``offsets_G1``)."""
    if x_TH.dim() != 2 or gate_up_G2FH.dim() != 3 or down_GHF.dim() != 3:
        raise ValueError(
            "expected x [T, H], gate_up [G, 2F, H], down [G, H, F]; got "
            f"{tuple(x_TH.shape)}, {tuple(gate_up_G2FH.shape)}, {tuple(down_GHF.shape)}"
        )
    T, H = x_TH.shape
    G, F2, H2 = gate_up_G2FH.shape
    if F2 % 2 or H2 != H or tuple(down_GHF.shape) != (G, H, F2 // 2):
        raise ValueError(
            f"weights do not fit x [T={T}, H={H}]: gate_up {tuple(gate_up_G2FH.shape)} "
            f"must be [G, 2F, {H}] and down {tuple(down_GHF.shape)} [G, {H}, F]"
        )
    if not (x_TH.dtype == gate_up_G2FH.dtype == down_GHF.dtype):
        raise ValueError(
            f"x, gate_up and down must share a dtype; got {x_TH.dtype}, "
            f"{gate_up_G2FH.dtype}, {down_GHF.dtype}"
        )
    if not x_TH.dtype.is_floating_point:
        raise ValueError(f"x must be floating point, got {x_TH.dtype}")
    if offsets_G1.dim() != 1 or offsets_G1.numel() != G + 1:
        raise ValueError(f"offsets must be [G+1] = [{G + 1}], got {tuple(offsets_G1.shape)}")
    if offsets_G1.dtype.is_floating_point or offsets_G1.dtype == torch.bool:
        raise ValueError(f"offsets must be integers, got {offsets_G1.dtype}")
    if bounds is not None and len(bounds) != G + 1:
        raise ValueError(f"bounds must hold the {G + 1} offsets, got {len(bounds)}")
    if values:
        _check_offsets(offsets_G1 if bounds is None else bounds, T)


def _check_offsets(offsets_G1: torch.Tensor | Sequence[int], T: int) -> None:
    """``offsets[0] == 0``, non-decreasing, ``offsets[-1] <= T < 2**31`` (one host read
    of a tensor; none of host integers)."""
    if isinstance(offsets_G1, torch.Tensor):
        off = [int(v) for v in offsets_G1.tolist()]  # one device-to-host copy
    else:
        off = [int(v) for v in offsets_G1]
    if off[0] != 0:
        raise ValueError(f"offsets[0] must be 0, got {off[0]}")
    if any(b < a for a, b in pairwise(off)):
        raise ValueError(f"offsets must be non-decreasing, got {off}")
    if off[-1] > T:
        raise ValueError(f"offsets[-1] = {off[-1]} exceeds the {T} rows of x")
    if T >= 2**31:
        raise ValueError(f"{T} rows exceed the int32 offsets of torch._grouped_mm")
