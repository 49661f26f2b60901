"""What a layer derives from its ``MoEConfig``: the agreed resolution, labels, balancer.

Legend: R ranks, E experts, B slots.

:class:`~moonplan.runtime.layer_runtime.LayerRuntime` calls these at construction, and
again where a setting changes between steps (:mod:`moonplan.runtime.between_steps`:
``set_cost`` builds a new balancer, ``rehome`` new labels).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moonplan.comm.group import EPGroup
from moonplan.plan.home_order import label_of
from moonplan.runtime.balancer import Balancer
from moonplan.runtime.config import MoEConfig, Resolved


def agree_config(group: EPGroup, cfg: MoEConfig, what: str) -> Resolved:
    """Collective: ``cfg`` resolved on this group (:meth:`MoEConfig.resolve`), the same on
    every rank; else the same error on every rank: the ranks that could not resolve it
    (and why), or each setting that differs with its value per rank
    (:meth:`EPGroup.check_settings`, :meth:`EPGroup.fail_settings`)."""
    try:
        resolved = cfg.resolve(group.size)
    except Exception as exc:  # reported to every rank, not raised here alone
        group.fail_settings(what, exc)
    group.check_settings(what, resolved.agreed)
    return resolved


def home_labels(cfg: MoEConfig, device: torch.device) -> Tensor | None:
    """``label_E``: int64 ``[E]`` on ``device``, the label of each model expert under the
    config's ``home_order`` (:func:`~moonplan.plan.home_order.label_of`); ``None``
    without one (labels are model ids)."""
    order = cfg.sizes.home_order
    if order is None:
        return None
    return torch.tensor(label_of(list(order)), dtype=torch.int64, device=device)


def layer_balancer(cfg: MoEConfig, slots: int) -> Balancer:
    """The :class:`Balancer` of a layer of ``cfg`` with ``slots`` slots."""
    b = cfg.balancing
    return Balancer(b.balance, slots=slots, align=cfg.buffers.align, cost=b.cost)
