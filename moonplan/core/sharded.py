"""``ShardedExperts``: the one front end every moonplan experts module shares.

Legend: R ranks, E experts, E_r this rank's home experts, H hidden, F expert FFN size,
S tokens on this rank, K top-k.

Labels and model ids: the runtime works in *labels*, rank ``r`` owning the labels of its
linear block ``(lo, hi)`` (:mod:`moonplan.plan.home`). With the config's ``home_order``
label ``i`` is model expert ``home_order[i]`` (:mod:`moonplan.plan.home_order`); without
it (``None``) labels are model ids. The router's ids, the ``home_experts`` buffer, the
expert tensors' rows as the user gave them and the per-expert state-dict keys are model
ids; ``home_range``, ``last_plan`` and the slot tables are labels.

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

import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moonplan.comm.group import EPGroup
from moonplan.core.optimizer_rehome import watch
from moonplan.core.rehome import Moves, full_order, home_moves, move_rows, row_tensors
from moonplan.plan.home import home_start
from moonplan.plan.home_order import check_order, popular_order
from moonplan.plan.plan_type import Plan
from moonplan.plan.residency.home_choice import HomeOffer, judged_order
from moonplan.plan.residency.serving import empty_slots
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
        """The plan of the last forward (``None`` before the first), in expert labels:
        its expert ``i`` is model expert ``home_order[i]`` (model ids without a home
        order; module docstring)."""
        return self.runtime.last_plan

    @property
    def last_stats(self) -> StepStats | None:
        """Figures of the last forward (copies, prefetched rows, phase times; totals, none
        per expert)."""
        return self.runtime.last_stats


class ShardedExperts(RuntimeViews, nn.Module):
    """This rank's home experts of one MoE layer and the runtime that runs them.

    Attributes (set by :meth:`setup` and :meth:`start`):
        group: the :class:`EPGroup`. config: the layer's :class:`MoEConfig` (sizes set).
        num_experts, top_k: ``E`` (global) and ``K``.
        home_experts: int64 ``[E_r]`` model ids of the home experts, in the order of the
            expert tensors' rows (non-persistent buffer): ``home_order[lo:hi]``, or
            ``lo .. hi-1`` without a home order.
        home_range: ``(lo, hi)``: the *labels* of the home experts are ``lo .. hi-1``
            (the model ids too without a home order; module docstring).
        home_order: the config's ``home_order`` (a tuple of model ids) or ``None``.
        runtime: the :class:`LayerRuntime`. slots: ``B``.
    """

    expert_tensors: tuple[str, ...] = ()
    """Names of the sharded parameters (what checkpoints shard)."""

    per_expert_keys: bool = True
    """How ``state_dict()`` shows the expert tensors. ``True`` (the default): one key per
    home expert, ``<name>.<e>`` (``e`` the model expert id, whatever the home order), a
    view of its rows, so every key names one tensor of one size at any EP size and home
    order, as ``torch.distributed.checkpoint`` and torchtitan's checkpointer need (they
    store a plain tensor once per key).
    ``False``: this rank's home rows ``[E_r, ...]`` under the tensor's own name (the
    original keys; rows in this rank's label order, so they load only under the same EP
    size and home order). Set it with ``moonplan.checkpoint.per_expert_keys``;
    ``load_state_dict`` takes both layouts."""

    @property
    def config(self) -> MoEConfig:
        """The layer's :class:`MoEConfig` (sizes set): the runtime's once it is built, so
        a ``set_cost`` or a re-home shows here at once."""
        runtime: LayerRuntime | None = self.__dict__.get("runtime")
        return self._config if runtime is None else runtime.config

    @config.setter
    def config(self, cfg: MoEConfig) -> None:
        self._config = cfg

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
        self.home_order = cfg.sizes.home_order
        self.home_range = register_home(self, self.group, E, self.home_order)
        self.register_state_dict_post_hook(_split_experts)
        self.register_load_state_dict_pre_hook(_join_experts)
        return self.home_range

    def home_ids(self) -> list[int]:
        """Model ids of the home experts, in the order of the expert tensors' rows (the
        ``home_experts`` buffer as a Python list)."""
        return home_ids(self.home_range, self.home_order)

    def home_text(self) -> str:
        """The home experts for ``extra_repr``: ``home=[lo, hi)`` without a home order,
        else ``home=<model ids>`` (at most 8 shown)."""
        if self.home_order is None:
            lo, hi = self.home_range
            return f"home=[{lo}, {hi})"
        ids = self.home_ids()
        return f"home={ids if len(ids) <= 8 else f'{ids[:8]} ... ({len(ids)})'}"

    def start(self, what: str) -> None:
        """Build the :class:`LayerRuntime` (collective; ``what`` names the layer in errors)."""
        self.runtime = LayerRuntime(self.group, self.config, what=what)
        self.slots = self.runtime.B
        # the last optimizer that stepped every expert tensor (auto's re-homes in training)
        self._stepper: weakref.ref[torch.optim.Optimizer] | None = None
        if self.config.balancing.rehome and self.config.balancing.balance == "auto":
            watch(self)  # told of each optimizer step

    def rehome(
        self,
        order: Sequence[int] | str,
        *,
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
    ) -> int:
        """Collective, between steps: own the experts of home ``order`` from now on (as
        if the layer had been built with ``home_order=order``); the experts that changed
        rank (over all ranks).

        Each expert's rows go from its old home rank to its new one, with its gradient
        and the state of ``optimizers`` (:mod:`moonplan.core.rehome`), into the same
        Parameters. The identity order restores the linear map (``home_order`` ``None``).
        The slots empty and any refill or decision in flight is dropped (the residency's
        window keeps its loads, relabelled: ``Decisions.relabel``); ``last_plan`` is
        ``None`` until the next step (labels changed meaning). The current order changes
        nothing (returns 0, the slots stay).

        Args:
            order: a permutation of the ``E`` model expert ids (e.g.
                :func:`~moonplan.plan.home_order.popular_order` of a profile), the same on
                every rank; or ``"profile"``: ``popular_order`` of the layer's own loads
                over its last steps (:meth:`LayerRuntime.recent_loads`, the same on every
                rank), its groups kept on the ranks that own most of them; with
                ``balance="auto"`` and its cost model, that order or the one of each
                expert's load per replica (``home_choice.shared_order``), only where
                the cost model predicts the steps faster under it, with no slot kept,
                than the slots serving now (of both: the one whose best table is
                faster; after a step with autograd on, when no slot outlives a step:
                the popular order, against the current map with none kept;
                :func:`~moonplan.plan.residency.home_choice.judged_order`), else the
                current order (nothing moves).
            optimizers: the optimizers that hold state of these Parameters. Required in
                training mode (``()``: none does), so that no state is left behind rows
                that moved; in eval mode ``None`` means none.

        Raises:
            PlanError, ValueError: on every rank: ``order`` is no permutation of the
                experts, ``optimizers`` is missing in training mode, or an optimizer
                holds state of a shape whose rows cannot follow (named).
            ContractError: on every rank: ranks gave different orders, failed
                differently, or hold different numbers of tensors to move.
        """
        return self._rehome(order, optimizers, None)

    def _rehome(
        self,
        order: Sequence[int] | str,
        optimizers: Sequence[torch.optim.Optimizer] | None,
        offer: HomeOffer | None,
    ) -> int:
        """:meth:`rehome`; ``offer``: the placer's offer that chose ``order`` (its steps
        then serve the offer's way, as a ``"profile"`` order judged here serves its
        judgement's)."""
        current = full_order(self.home_order, self.num_experts)
        try:
            new, judged = self._order(order, current)
            if optimizers is None and self.training:
                raise ValueError(
                    "rehome in training mode needs optimizers=[...] (the optimizers whose "
                    "state follows the rows; () if none holds these parameters)"
                )
            params = [getattr(self, name) for name in self.expert_tensors]
            tensors = [row_tensors(p, optimizers or ()) for p in params]
            err: Exception | None = None
        except (ValueError, TypeError) as exc:
            err = exc
        self.group.outcome("rehome", err)
        self.group.check_same("home order", tuple(new))
        self.group.check_same("tensors to re-home", tuple(len(ts) for ts in tensors))
        if new == current:
            return 0
        moves = home_moves(current, new, self.group.size, self.group.rank)
        kept = None if new == list(range(self.num_experts)) else tuple(new)
        cfg = self.config.replace(home_order=kept)
        self.runtime.rehome(cfg, lambda: self._move(tensors, moves), offer or judged)
        self.home_order = kept
        ids_Er = home_ids(self.home_range, kept)
        self.get_buffer("home_experts").copy_(torch.tensor(ids_Er, dtype=torch.int64))
        return moves.moved

    def _order(
        self, order: Sequence[int] | str, current: list[int]
    ) -> tuple[list[int], HomeOffer | None]:
        """The checked new order: ``order``, or for ``"profile"`` the one of the recent
        loads (:meth:`rehome`); and the judgement that chose it, if any."""
        if not isinstance(order, str):
            return check_order(order, self.num_experts), None
        if order != "profile":
            raise ValueError(f"order must be a permutation or 'profile', got {order!r}")
        if self.runtime.window.filled == 0:
            raise ValueError("rehome('profile') needs the loads of a step: run one first")
        R, loads_SE = self.group.size, self.runtime.window.loads()  # by label
        cost = self.runtime.auto_cost()
        if cost is None:  # no cost model to judge it by: the order as it is
            return popular_order(self.runtime.recent_loads(), R, current), None
        rt = self.runtime
        if rt.serving:  # against the slots serving now
            kept = rt.resident
            serving_RB = empty_slots(R, rt.B) if kept is None else kept.slot_expert
            judged = judged_order(cost, loads_SE, R, rt.B, serving_RB)
        else:  # training: every step changes the weights, no slot is kept either way
            judged = judged_order(cost, loads_SE, R, rt.B, stale=True)
        if judged is None:
            return current, None
        return [current[j] for j in judged.perm_E], judged

    def step_begins(self) -> None:
        """Call before a step reads the parameters (collective where it acts: every rank
        answers alike): ``balance="auto"``'s own re-homes. Serving, once, where
        :meth:`LayerRuntime.rehome_due` says (``rehome("profile")``: only where the cost
        model favours the order; no optimizer holds state, as no step ran with autograd
        on). In training, where the placer's decisions have offered one (rent or buy:
        ``moonplan.plan.residency.refill.Residency``; the same offer on every rank), with
        the state of the optimizer that last stepped every expert tensor
        (:meth:`optimizer_stepped`)."""
        if self.runtime.rehome_due():
            self.runtime.rehome_judged = True
            self.rehome("profile", optimizers=())
            return
        offer = self.runtime.take_home_offer()
        if offer is None:
            return
        optimizer = None if self._stepper is None else self._stepper()
        current = full_order(self.home_order, self.num_experts)
        new = [current[j] for j in offer.perm_E]
        self._rehome(new, None if optimizer is None else [optimizer], offer)

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer, held: set[int]) -> bool:
        """Told of each optimizer step by :mod:`moonplan.core.optimizer_rehome` (``held``:
        ids of the Parameters ``optimizer`` holds); ``True`` once no step is needed any
        more. No collective: this rank only takes note.

        An optimizer that holds every expert tensor of the layer is the one whose state a
        training re-home moves (:meth:`step_begins`), and sets what a re-home would move
        here per byte of weights (``LayerRuntime.own_move_bytes``: the rows, their
        gradients and that optimizer's state), which the next step's counts exchange
        agrees across ranks for the placer's decisions (``LayerRuntime.move_bytes``: a
        ``ContractError`` on every rank where ranks differ). An optimizer that holds only
        some of the tensors, or state whose rows cannot follow (a factored statistic),
        cannot: a warning, and this rank never re-homes the layer in training. One that
        holds none is another optimizer.
        """
        if not self.config.balancing.rehome:
            return True
        inside = [id(getattr(self, name)) in held for name in self.expert_tensors]
        if not any(inside):
            return False
        try:
            if not all(inside):
                raise ValueError(
                    f"{type(optimizer).__name__} holds only some of its expert tensors "
                    f"{self.expert_tensors}: the others' optimizer state could not follow"
                )
            self.runtime.own_move_bytes = self._move_ratio(optimizer)
        except ValueError as exc:
            self.runtime.own_move_bytes, self._stepper = 0.0, None
            warnings.warn(
                f"balance='auto' will not re-home this layer in training: {exc}. Call "
                "moonplan.rehome_model(model, 'profile', optimizers=[...]) yourself, or "
                "set MoEConfig(rehome=False) to silence this",
                RuntimeWarning,
                stacklevel=2,
            )
            return True
        self._stepper = weakref.ref(optimizer)
        return False

    def _move_ratio(self, optimizer: torch.optim.Optimizer) -> float:
        """The bytes of the expert tensors' rows, gradients and ``optimizer``'s state over
        those of their weights (what a re-home moves per byte of weights)."""
        params = [getattr(self, name) for name in self.expert_tensors]
        moved = sum(
            t.numel() * t.element_size() for p in params for t in row_tensors(p, [optimizer])
        )
        weights = sum(p.numel() * p.element_size() for p in params)
        return moved / weights if weights else 0.0

    @torch.no_grad()
    def _move(self, tensors: list[list[torch.Tensor]], moves: Moves) -> None:
        """Collective: every tensor's rows to their new home (one all-to-all each)."""
        for ts in tensors:
            for t in ts:
                t.copy_(move_rows(self.group, t, moves))


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
    for each home expert ``e``, a model id (views: loading into them in place, as
    ``torch.distributed.checkpoint.load`` does, writes the parameter)."""
    assert isinstance(module, ShardedExperts)
    if not module.per_expert_keys:
        return
    ids = module.home_ids()
    for name in module.expert_tensors:
        home = state.pop(prefix + name)
        for row, e in enumerate(ids):
            state[f"{prefix}{name}.{e}"] = home[row]


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
    ``<prefix><name>.<e>`` (``e`` a model id; saved under any EP size and home order:
    this rank's home experts are taken, in its rows' order, those of other ranks dropped)
    become ``<prefix><name> [E_r, ...]``; a home expert missing among them is an error
    naming its key."""
    assert isinstance(module, ShardedExperts)
    ids = module.home_ids()
    for name in module.expert_tensors:
        keys = {e: f"{prefix}{name}.{e}" for e in range(module.num_experts)}
        if not any(k in state for k in keys.values()):
            if not ids and module.per_expert_keys and prefix + name not in state:
                state[prefix + name] = getattr(module, name).detach()  # no experts here
            continue
        rows = [state.get(keys[e]) for e in ids]
        for k in keys.values():
            state.pop(k, None)
        absent = [keys[e] for e, row in zip(ids, rows, strict=True) if row is None]
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


def register_home(
    module: nn.Module, group: EPGroup, num_experts: int, order: Sequence[int] | None = None
) -> tuple[int, int]:
    """This rank's home labels ``(lo, hi)`` (its linear block) of ``num_experts``.

    Registers the model ids of its home experts on ``module`` as the non-persistent
    int64 buffer ``home_experts [E_r]`` on the group's device: ``order[lo:hi]`` under a
    home ``order`` (a checked permutation of the ``E`` experts), else ``lo .. hi-1``.
    """
    R, r = group.size, group.rank
    lo, hi = home_start(r, num_experts, R), home_start(r + 1, num_experts, R)
    ids_Er = torch.tensor(home_ids((lo, hi), order), dtype=torch.int64, device=group.device)
    module.register_buffer("home_experts", ids_Er, persistent=False)
    return lo, hi


def home_ids(home_range: tuple[int, int], order: Sequence[int] | None) -> list[int]:
    """Model ids of the experts labelled ``lo .. hi-1``: ``order[lo:hi]``, or the labels
    themselves without a home ``order``."""
    lo, hi = home_range
    return list(range(lo, hi)) if order is None else list(order[lo:hi])


def home_rows(
    full: torch.Tensor, lo: int, hi: int, order: Sequence[int] | None = None
) -> torch.Tensor:
    """This rank's home rows ``[E_r, ...]`` of ``full [E, ...]`` (rows by model id):
    ``full[lo:hi]`` (a view), or under a home ``order`` the rows of model experts
    ``order[lo:hi]`` (a new tensor)."""
    if order is None:
        return full[lo:hi]
    idx_Er = torch.tensor(list(order[lo:hi]), dtype=torch.int64, device=full.device)
    return full.index_select(0, idx_Er)


def home_parameter(
    full: torch.Tensor, lo: int, hi: int, order: Sequence[int] | None = None
) -> nn.Parameter:
    """A Parameter holding a copy of this rank's home rows of ``full [E, ...]``
    (:func:`home_rows`; the full tensor is not referenced).

    It requires grad unless ``full`` is a Parameter that does not (frozen experts).
    """
    with torch.no_grad():
        home = home_rows(full.detach(), lo, hi, order).clone()
    trainable = full.requires_grad if isinstance(full, nn.Parameter) else True
    return nn.Parameter(home, requires_grad=trainable)


def options_config(config: MoEConfig | None, options: dict[str, Any], **given: Any) -> MoEConfig:
    """``config`` with the keyword ``options`` and the ``given`` values that are not ``None``
    replacing its fields (see :meth:`MoEConfig.merged`)."""
    return MoEConfig.merged(config, **options, **{k: v for k, v in given.items() if v is not None})
