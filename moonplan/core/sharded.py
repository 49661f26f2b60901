"""``ShardedExperts``: the one front end every moonplan experts module shares.

Legend: R ranks, E experts, E_r this rank's home experts, H hidden, F expert FFN size,
S tokens on this rank, K top-k.

A sharded experts module (:class:`~moonplan.core.experts.MoonExperts`, torchtitan's
:class:`~moonplan.adapters.torchtitan.MoonGroupedExperts`, and through ``MoonExperts``
:class:`~moonplan.MoonMoE`) holds the EP group, its
:class:`~moonplan.runtime.config.MoEConfig`, this rank's home experts and the
:class:`~moonplan.runtime.layer_runtime.LayerRuntime` that owns the step. Subclasses
name their parameters (``expert_tensors``) and call :meth:`ShardedExperts.setup`,
then :meth:`ShardedExperts.start`, in their constructor; their forward hands the step
to ``runtime.forward``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moonplan.comm.group import EPGroup
from moonplan.plan.home import home_start
from moonplan.plan.plan_type import Plan
from moonplan.runtime.config import MoEConfig
from moonplan.runtime.layer_runtime import LayerRuntime
from moonplan.runtime.step_stats import StepStats
from moonplan.stepcost import StepCost


class RuntimeViews:
    """What a layer shows of its ``runtime`` (a :class:`LayerRuntime`): the last plan and
    figures, the cost model (``set_cost``), calibration and ``weights_changed``. Shared by
    :class:`ShardedExperts` and :class:`~moonplan.MoonMoE`."""

    runtime: LayerRuntime

    def weights_changed(self) -> None:
        """Mark every slot stale after a change torch's version counters cannot see."""
        self.runtime.weights_changed()

    def calibrate(self) -> StepCost:
        """Collective: the layer's :class:`StepCost` from its measured steps, agreed across
        ranks; ``balance="auto"`` plans with it from the next step."""
        return self.runtime.calibrate()

    def set_cost(self, cost: StepCost) -> None:
        """Collective: plan ``balance="auto"`` with ``cost`` from the next step on, agreed
        across ranks like the config (``LayerRuntime.set_cost``)."""
        self.runtime.set_cost(cost)

    @property
    def cost(self) -> StepCost | None:
        """The cost model ``balance="auto"`` plans with (``None`` until calibrated)."""
        return self.runtime.balancer.cost

    @property
    def last_plan(self) -> Plan | None:
        """The plan of the last forward (``None`` before the first)."""
        return self.runtime.last_plan

    @property
    def last_stats(self) -> StepStats | None:
        """Figures of the last forward (copies, prefetched rows, phase times)."""
        return self.runtime.last_stats


class ShardedExperts(RuntimeViews, nn.Module):
    """This rank's home experts of one MoE layer and the runtime that runs them.

    Attributes (set by :meth:`setup` and :meth:`start`):
        group: the :class:`EPGroup`. config: the layer's :class:`MoEConfig` (sizes set).
        num_experts, top_k: ``E`` (global) and ``K``.
        home_experts: int64 ``[E_r]`` global ids of the home experts (non-persistent buffer).
        home_range: ``(lo, hi)``: the home experts are ``lo .. hi-1``.
        runtime: the :class:`LayerRuntime`. slots: ``B``.
    """

    expert_tensors: tuple[str, ...] = ()
    """Names of the sharded parameters (what checkpoints shard)."""

    per_expert_keys: bool = True
    """How ``state_dict()`` shows the expert tensors. ``True`` (the default): one key per
    home expert, ``<name>.<e>`` (``e`` the global expert id), a view of its rows, so every
    key names one tensor of one size at any EP size, as ``torch.distributed.checkpoint``
    and torchtitan's checkpointer need (they store a plain tensor once per key).
    ``False``: this rank's home rows ``[E_r, ...]`` under the tensor's own name (the
    original keys). Set it with ``moonplan.checkpoint.per_expert_keys``;
    ``load_state_dict`` takes both layouts."""

    def setup(
        self, group: EPGroup | object | None, cfg: MoEConfig, device: torch.device | None
    ) -> tuple[int, int]:
        """Resolve the group, keep ``cfg`` (sizes set), register the home experts ``(lo, hi)``.

        ``device``: where the given weights are (``None``: no weights given); they must be
        on the group's device.
        """
        _, _, E, K = cfg.require_sizes()
        self.group = resolve_group(group, device)
        dev = self.group.device
        if device is not None and device != dev:
            raise ValueError(
                f"expert weights are on {device} but the EP group communicates on {dev}; "
                f"move the module to {dev} before wrapping it"
            )
        self.config, self.num_experts, self.top_k = cfg, E, K
        self.home_range = register_home(self, self.group, E)
        self.register_state_dict_post_hook(_split_experts)
        self.register_load_state_dict_pre_hook(_join_experts)
        return self.home_range

    def start(self, what: str) -> None:
        """Build the :class:`LayerRuntime` (collective; ``what`` names the layer in errors)."""
        self.runtime = LayerRuntime(self.group, self.config, what=what)
        self.slots = self.runtime.B


@contextmanager
def agreed_construction(group: EPGroup, what: str) -> Iterator[None]:
    """Run a front end's construction up to its :class:`LayerRuntime` so that a failure
    on some ranks only raises the same error on every rank.

    The body's exception (an invalid option, weights of a bad shape...) is not raised
    alone: the failing rank enters the runtime's config agreement, the first collective
    of a layer's construction, as a failing rank (:meth:`EPGroup.fail_settings`), where
    its peers, done with their body, wait. So every rank raises the original error where
    every rank failed alike, else the same ``ContractError`` naming each failing rank.
    The body must not build the runtime (call :meth:`ShardedExperts.start` after it).
    """
    try:
        yield
    except Exception as exc:
        group.fail_settings(f"{what} config", exc)


def _split_experts(module: nn.Module, state: dict[str, Any], prefix: str, _: Any) -> None:
    """``state_dict`` post-hook of a :class:`ShardedExperts`: where ``per_expert_keys`` is
    set, each expert tensor ``<prefix><name> [E_r, ...]`` becomes ``<prefix><name>.<e>``
    for each home expert ``e`` (views: loading into them in place, as
    ``torch.distributed.checkpoint.load`` does, writes the parameter)."""
    assert isinstance(module, ShardedExperts)
    if not module.per_expert_keys:
        return
    lo, hi = module.home_range
    for name in module.expert_tensors:
        home = state.pop(prefix + name)
        for e in range(lo, hi):
            state[f"{prefix}{name}.{e}"] = home[e - lo]


def _join_experts(
    module: nn.Module,
    state: dict[str, Any],
    prefix: str,
    _: Any,
    strict: bool,
    missing: list[str],
    unexpected: list[str],
    errors: list[str],
) -> None:
    """``load_state_dict`` pre-hook of a :class:`ShardedExperts`: per-expert keys
    ``<prefix><name>.<e>`` (any layout: this rank's home experts are taken, those of
    other ranks dropped) become ``<prefix><name> [E_r, ...]``; a home expert missing
    among them is an error naming its key."""
    assert isinstance(module, ShardedExperts)
    lo, hi = module.home_range
    for name in module.expert_tensors:
        keys = {e: f"{prefix}{name}.{e}" for e in range(module.num_experts)}
        if not any(k in state for k in keys.values()):
            if lo == hi and module.per_expert_keys and prefix + name not in state:
                state[prefix + name] = getattr(module, name).detach()  # no experts here
            continue
        rows = [state.get(keys[e]) for e in range(lo, hi)]
        for k in keys.values():
            state.pop(k, None)
        absent = [keys[e] for e, row in zip(range(lo, hi), rows, strict=True) if row is None]
        if absent:
            errors.append(f"per-expert keys missing for this rank's experts: {absent}")
        elif prefix + name not in state:
            found = [row for row in rows if row is not None]
            state[prefix + name] = torch.stack(found) if found else getattr(module, name).detach()


def resolve_group(group: EPGroup | object | None, weights_device: torch.device | None) -> EPGroup:
    """The EP group; without torch.distributed, a single rank on the weights' device."""
    if isinstance(group, EPGroup):
        return group
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return EPGroup(None, device=weights_device)
    return EPGroup(group)


def register_home(module: nn.Module, group: EPGroup, num_experts: int) -> tuple[int, int]:
    """This rank's home experts ``(lo, hi)`` (global ids ``lo .. hi-1``) of ``num_experts``.

    Registers them on ``module`` as the non-persistent int64 buffer
    ``home_experts [E_r]`` on the group's device.
    """
    R, r = group.size, group.rank
    lo, hi = home_start(r, num_experts, R), home_start(r + 1, num_experts, R)
    module.register_buffer(
        "home_experts", torch.arange(lo, hi, device=group.device), persistent=False
    )
    return lo, hi


def home_parameter(full: torch.Tensor, lo: int, hi: int) -> nn.Parameter:
    """A Parameter holding a copy of ``full[lo:hi]`` (the full tensor is not referenced).

    It requires grad unless ``full`` is a Parameter that does not (frozen experts).
    """
    with torch.no_grad():
        home = full[lo:hi].detach().clone()
    trainable = full.requires_grad if isinstance(full, nn.Parameter) else True
    return nn.Parameter(home, requires_grad=trainable)


def options_config(config: MoEConfig | None, options: dict[str, Any], **given: Any) -> MoEConfig:
    """``config`` with the keyword ``options`` and the ``given`` values that are not ``None``
    replacing its fields (see :meth:`MoEConfig.merged`)."""
    return MoEConfig.merged(config, **options, **{k: v for k, v in given.items() if v is not None})
