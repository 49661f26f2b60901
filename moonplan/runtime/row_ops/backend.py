"""Which row-ops backend moves rows: the Triton peer-pointer kernels or their torch twins.

Legend: none (picks a module; the row ops themselves document their tensors).

Both modules have the same functions (``scatter_rows``, ``gather_rows``) and give
bit-identical results; so do the token-row pair ``token_torch`` / ``token_triton``
(``expand_rows``, ``reduce_rows``, ``row_dot``, ``segments``), picked the same way by
:func:`token_ops_for`. CUDA tensors use the Triton kernels (peer loads and stores
through the symmetric heap's addresses). CPU tensors use the torch twins, or the
same Triton kernels interpreted when ``MOONPLAN_ROW_OPS=triton`` and
``TRITON_INTERPRET=1`` are set (how the tests run the kernels over the
shared-memory heap's peer views). A missing Triton on CUDA is an error, never a
silent switch.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from moonplan.runtime.row_ops import token_torch
from moonplan.runtime.row_ops import torch as torch_ops

CHOICES = ("auto", "torch", "triton")


def row_ops_for(device: torch.device) -> ModuleType:
    """The row-ops module for tensors on ``device`` (see the module docstring)."""
    if not _kernels_for(device):
        return torch_ops
    from moonplan.runtime.row_ops import triton as triton_ops

    return triton_ops


def token_ops_for(device: torch.device) -> ModuleType:
    """The token-row ops module for tensors on ``device`` (see the module docstring)."""
    if not _kernels_for(device):
        return token_torch
    from moonplan.runtime.row_ops import token_triton

    return token_triton


def _kernels_for(device: torch.device) -> bool:
    """Whether tensors on ``device`` use the Triton kernels; raises where they should
    but cannot run."""
    choice = os.environ.get("MOONPLAN_ROW_OPS", "auto")
    if choice not in CHOICES:
        raise ValueError(f"MOONPLAN_ROW_OPS must be one of {CHOICES}, got {choice!r}")
    if choice == "torch" or (choice == "auto" and device.type != "cuda"):
        return False
    from moonplan.runtime.row_ops import triton as triton_ops

    ok, why = triton_ops.available(device)
    if not ok:
        raise RuntimeError(
            f"row movement on {device} uses the Triton kernels, which cannot run here: {why}. "
            "Install triton (the 'triton' extra), or set MOONPLAN_ROW_OPS=torch to use the "
            "torch ops explicitly."
        )
    return True
