"""``StepContext``: what one MoE step runs on, handed from the layer runtime to the step.

Legend: M home rows per rank (``ceil(E/R)``), B slots per rank.

The step function (:mod:`moonplan.runtime.moe_function`) needs five things of its layer,
not the whole :class:`~moonplan.runtime.layer_runtime.LayerRuntime`: the transport that
moves its rows, the expert store that holds its weights, the reducer that sends replica
gradients home, the lane its prefetch and reduce run in, and the sizes of the store's
sections. The runtime takes them once per step (:meth:`LayerRuntime.context`), so a
step's backward uses the objects its forward used.
"""

from __future__ import annotations

from dataclasses import dataclass

from moonplan.runtime.background import BackgroundLane
from moonplan.runtime.store import ExpertStore, GradReducer
from moonplan.runtime.transports.base import Transport


@dataclass(frozen=True)
class StepContext:
    """One step's layer objects (see the module docstring).

    Attributes:
        transport: moves the step's rows (dispatch, combine and their backwards).
        store: the expert store: home rows ``[M, ...]``, then ``B`` slots, per projection.
        reducer: sends replica-row weight gradients to their home ranks.
        lane: where the prefetch and the reduce run (a worker, a side stream, inline).
        rank: this rank in the EP group.
        home_rows: ``M``, where the store's slots start.
        slots: ``B``; the direct rows' weights come after the slots (row ``M + B``).
    """

    transport: Transport
    store: ExpertStore
    reducer: GradReducer
    lane: BackgroundLane
    rank: int
    home_rows: int
    slots: int
