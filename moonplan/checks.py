"""Argument checks shared by the front ends and the trace generators.

Legend: ``name`` the argument's name as the caller spells it (the error names it);
``low``/``high`` the bounds it must lie in.

A failed check raises ``ValueError`` saying which argument, what it must be and what
it got (``"top_k must be an integer >= 1, got 0"``). This module imports nothing of
moonplan, so any layer may use it without an import cycle.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def check_int(name: str, value: Any, low: int) -> int:
    """``value`` as a Python ``int`` if it is an integer (Python or NumPy, not a bool)
    ``>= low``; else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_range(name: str, value: float, low: float, high: float) -> float:
    """``value`` as a ``float`` if it is a number in ``[low, high]``; else ``ValueError``."""
    if not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
    return float(value)
