"""Counts files: one step ``[R, E]`` or a trace ``[T, R, E]`` as ``.json``, ``.npy`` or ``.npz``.

Legend: T steps, R ranks, E experts; counts are non-negative int64 (CPU).
Written by :func:`save_counts` (and ``traces.recorder.TraceRecorder``), read by
:func:`load_counts`, ``moonplan plan FILE`` and the simulator. A ``.npz`` file (numpy's
compressed archive, the shipped real traces) holds one array; any integer dtype is read.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

_SUFFIXES = (".json", ".npy", ".npz")


def save_counts(path: str | Path, counts: Any) -> None:
    """Write counts ``[R, E]`` or a trace ``[T, R, E]`` to ``.json`` (nested lists), ``.npy`` or
    ``.npz`` (compressed, one array named ``counts``).

    Args:
        path: destination; its suffix picks the format.
        counts: non-negative integers (tensor, numpy array or nested lists).

    Raises:
        ValueError: unknown suffix, or counts not a 2-D/3-D non-negative integer array.
    """
    p = Path(path)
    suffix = _suffix(p)
    counts_T = _as_trace_counts(counts, f"counts to save to {p}")
    if suffix == ".json":
        p.write_text(json.dumps(counts_T.tolist()) + "\n")
    elif suffix == ".npz":
        np.savez_compressed(p, counts=counts_T.numpy())
    else:
        np.save(p, counts_T.numpy(), allow_pickle=False)


def load_counts(path: str | Path) -> torch.Tensor:
    """Read counts written by :func:`save_counts` (or by hand, same formats).

    Returns:
        int64 ``[R, E]`` or ``[T, R, E]`` (CPU), as stored.

    Raises:
        ValueError: unknown suffix, unreadable file, or not a 2-D/3-D
            non-negative integer array with every dimension >= 1.
    """
    p = Path(path)
    suffix = _suffix(p)
    try:
        if suffix == ".json":
            data: Any = json.loads(p.read_text())
        elif suffix == ".npz":
            data = _only_array(p)
        else:
            data = np.load(p, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"could not read counts from {p}: {exc}") from None
    return _as_trace_counts(data, f"counts in {p}")


def _only_array(p: Path) -> np.ndarray:
    """The one array of a ``.npz`` archive (``ValueError`` if it holds several or none)."""
    with np.load(p, allow_pickle=False) as archive:
        names = list(archive.files)
        if len(names) != 1:
            raise ValueError(f"a counts archive holds one array, {p.name} holds {names}")
        return archive[names[0]]


def _suffix(p: Path) -> str:
    suffix = p.suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(f"counts files must end in {' or '.join(_SUFFIXES)}, got {p.name!r}")
    return suffix


def _as_trace_counts(data: Any, what: str) -> torch.Tensor:
    try:
        t = data if isinstance(data, torch.Tensor) else torch.as_tensor(np.asarray(data))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{what} must be a rectangular integer array: {exc}") from None
    if t.dim() not in (2, 3) or min(t.shape) < 1:
        raise ValueError(
            f"{what} must have shape [R, E] or [steps, R, E], all >= 1; got {tuple(t.shape)}"
        )
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{what} must be integers, got dtype {t.dtype}")
    t = t.to(torch.int64).cpu()
    if bool((t < 0).any()):
        raise ValueError(f"{what} must be non-negative, found {int(t.min())}")
    return t
