"""The ``balance=`` option of MoonMoE and the wrappers: ``"auto"``, ``"exact"`` or ``"off"``.

Legend: none (no tensors).

* ``"exact"``: every step the exactly balanced plan (``moonplan.plan``, the
  planner's ``policy="exact"``);
* ``"off"``: static expert parallelism, every record on its home rank (the baseline);
* ``"auto"`` (default): per step the plan with the least predicted step time among
  the planner's candidates (exact, bounded imbalance, resident-only, static), by the
  runtime's :class:`~moonplan.stepcost.StepCost` (see ``docs/runtime.md``).

``True``/``False`` (the old bool) are accepted for one release with a
``DeprecationWarning`` and mean ``"exact"``/``"off"``.
"""

from __future__ import annotations

import warnings

MODES = ("auto", "exact", "off")
DEFAULT = "auto"


def balance_mode(value: str | bool, *, stacklevel: int = 3) -> str:
    """The mode ``value`` names; bools map to ``"exact"``/``"off"`` with a DeprecationWarning.

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, bool):
        mode = "exact" if value else "off"
        warnings.warn(
            f"balance={value} is deprecated; use balance={mode!r} "
            f"(modes: {', '.join(MODES)}; default {DEFAULT!r})",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        return mode
    if value not in MODES:
        raise ValueError(f"balance must be one of {MODES}, got {value!r}")
    return value
