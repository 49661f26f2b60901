"""The former home of :class:`~moonplan.runtime.layer_runtime.LayerRuntime` (renamed after
its concept); re-exports it and :class:`~moonplan.runtime.step_stats.StepStats` for the
modules that still import them from here.

Legend: none (no tensors).
"""

from moonplan.runtime.layer_runtime import LayerRuntime
from moonplan.runtime.step_stats import StepStats

__all__ = ["LayerRuntime", "StepStats"]
