"""Tensors or arrays as numpy arrays on the host: what the planner's host paths and the
step-time model read.

Legend:
    a  a torch tensor (any device, any dtype, with or without autograd), a numpy array,
       or nested lists of numbers; any shape, kept as it is

The planner (``moonplan.plan``) and the cost model (``moonplan.stepcost``) both take
either form and work on numpy, so the conversion lives here, in a leaf both import.
A CPU tensor or an array already of the wanted dtype is returned without a copy (the
tensor's memory, seen as an array); a tensor on another device is copied to the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def host_int64(a: Any) -> np.ndarray:
    """``a`` (see the legend) as an int64 numpy array of the same shape (no copy where
    ``a`` already is an int64 array or an int64 CPU tensor)."""
    if isinstance(a, np.ndarray) and a.dtype == np.int64:
        return a
    return np.asarray(host_numpy(a), dtype=np.int64)


def host_bool(a: Any) -> np.ndarray:
    """``a != 0`` (see the legend) as a bool numpy array of the same shape (no copy where
    ``a`` already is a bool array or a bool CPU tensor)."""
    out = np.asarray(host_numpy(a))
    return out if out.dtype == np.bool_ else out != 0


def host_numpy(a: Any) -> Any:
    """A torch tensor (any device, detached from autograd) as a numpy array on the host,
    sharing the tensor's memory where it is on the CPU; anything else as it is."""
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    return a
