"""A training step of one MoE layer: its forward (``StepCost.step_time``) and its backward.

Legend: none (seconds per phase).

The backward replays the forward's plan (no planning) over the same ranks and links:

* the output gradients go where the records ran, as the dispatch sent the rows: the
  forward's ``dispatch_s`` again;
* the experts' backward computes the input gradients and the weight gradients, each the
  forward's grouped GEMMs over the same rows: twice the forward's ``experts_s`` (the same
  slowest rank);
* the input gradients come home as the combine brought the outputs: ``combine_s`` again;
* each replica's weight gradient goes home over the links its weights came by (the
  runtime sends it beside the backward): exposed as the forward's fetch was,
  ``prefetch_exposed_s`` again.

So a plan's imbalance costs a training step about three times its forward's share of
the experts phase, while what is moved once between steps (a re-home's rows) costs the
same. The forward-only :class:`~moonplan.stepcost.StepTime` of a training step
understates the first and not the second.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch

from moonplan.stepcost.step_cost import StepTime

BACKWARD_GEMMS = 2
"""The backward's grouped GEMMs per forward GEMM: the input gradients and the weights'."""

T = TypeVar("T", float, torch.Tensor)
T_co = TypeVar("T_co", float, torch.Tensor, covariant=True)


class Phases(Protocol[T_co]):
    """The forward phases a backward replays: a ``StepTime`` (floats) or a
    ``stepcost.batch.BatchTime`` (tensors)."""

    @property
    def dispatch_s(self) -> T_co: ...
    @property
    def experts_s(self) -> T_co: ...
    @property
    def combine_s(self) -> T_co: ...
    @property
    def prefetch_exposed_s(self) -> T_co: ...


def backward_s(forward: Phases[T]) -> T:
    """Seconds of the backward that replays ``forward``'s plan (module docstring), a float
    or a tensor as its phases are."""
    experts_s = BACKWARD_GEMMS * forward.experts_s
    return forward.dispatch_s + experts_s + forward.combine_s + forward.prefetch_exposed_s


def training_time(forward: StepTime) -> StepTime:
    """The training step of ``forward``: each phase its forward's and its backward's sum
    (planning once), the total the forward's plus :func:`backward_s`."""
    return StepTime(
        plan_s=forward.plan_s,
        prefetch_s=2 * forward.prefetch_s,
        prefetch_exposed_s=2 * forward.prefetch_exposed_s,
        dispatch_s=2 * forward.dispatch_s,
        experts_s=(1 + BACKWARD_GEMMS) * forward.experts_s,
        combine_s=2 * forward.combine_s,
        total_s=forward.total_s + backward_s(forward),
    )
