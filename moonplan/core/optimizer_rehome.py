"""``balance="auto"``'s re-homes in training: the optimizer whose state moves.

A trained layer's rows carry optimizer state (Adam's moments...) that only the optimizer
holds. Each ``optimizer.step()`` whose param groups hold every expert tensor of a layer is
noted by that layer (:meth:`ShardedExperts.optimizer_stepped
<moonplan.core.sharded.ShardedExperts.optimizer_stepped>`): its state is what a re-home
moves with the rows, and the bytes it carries per byte of weights go to the placer's
decisions, agreed across ranks by the next step's counts exchange. Where those decisions
offer a re-home (rent or buy, ``moonplan.plan.residency.refill.Residency``), the layer
takes it at the start of its next step (:meth:`ShardedExperts.step_begins
<moonplan.core.sharded.ShardedExperts.step_begins>`), on every rank alike. The hook runs
no collective: a rank whose optimizer differs gets the same error as every other rank at
the next step, and none waits for another.

The layers are watched here, in the order they were built. One post-hook common to all
of torch's optimizers (``torch.optim.optimizer.register_optimizer_step_post_hook``)
serves them; it is installed with the first watched layer and stays (torch runs its
hooks from a dict that must not change while they run); with nothing watched it returns
at once.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle


class Stepped(Protocol):
    """A layer told of each optimizer step (``ShardedExperts``)."""

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer, held: set[int]) -> bool:
        """Act on ``optimizer``'s step (``held``: ids of the Parameters it holds); ``True``
        once the layer needs no further optimizer steps."""
        ...


_WATCHED: list[weakref.ref[Any]] = []  # layers in build order (Stepped)
_HOOK: list[RemovableHandle] = []  # the one global post-hook, once installed


def watch(layer: Stepped) -> None:
    """Tell ``layer`` of every optimizer step from now on, until it says it is done (or
    is garbage collected); installs the global post-hook on the first call."""
    _WATCHED.append(weakref.ref(layer))
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(_stepped))


def watched() -> list[Stepped]:
    """The live watched layers, in build order."""
    return [layer for layer in (ref() for ref in _WATCHED) if layer is not None]


def _stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The post-hook: tell each watched layer, in build order; forget the done ones."""
    if not _WATCHED:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for ref in list(_WATCHED):
        layer = ref()
        if layer is None or layer.optimizer_stepped(optimizer, held):
            _WATCHED.remove(ref)
