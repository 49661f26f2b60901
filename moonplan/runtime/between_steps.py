"""``BetweenSteps``: what a layer does between its steps: calibrate, re-home, refill.

Legend: R ranks, E experts, B slots, S refill staging rows.

The base of :class:`~moonplan.runtime.layer_runtime.LayerRuntime` that holds what the
front ends call between steps, and the step itself where ``balance="auto"`` calibrates
or orders a refill: the cost model ``auto`` plans with (:meth:`BetweenSteps.calibrate`,
:meth:`BetweenSteps.set_cost`, :meth:`BetweenSteps.auto_cost`), a new home order
(:meth:`BetweenSteps.rehome`; :meth:`BetweenSteps.rehome_due` says when ``auto`` takes
one by itself, :meth:`BetweenSteps.recent_loads` gives the profile), a background refill
of the slots (:meth:`BetweenSteps.request_refill`, :mod:`moonplan.runtime.refill`) and
home weights changed where torch cannot see it (:meth:`BetweenSteps.weights_changed`).
Each collective one is agreed on every rank, or raises the same error everywhere.
Everything is in expert labels, as in the step (:mod:`moonplan.runtime.layer_runtime`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from moonplan.comm.errors import ContractError
from moonplan.plan.plan_type import Plan
from moonplan.plan.residency.home_choice import HomeOffer
from moonplan.plan.residency.serving import empty_slots
from moonplan.plan.residency.window import LoadWindow
from moonplan.runtime.balancer import Balancer
from moonplan.runtime.calibrate import time_local_copy
from moonplan.runtime.config import MoEConfig, cost_settings
from moonplan.runtime.layer_resources import LayerResources
from moonplan.runtime.layer_setup import home_labels, layer_balancer
from moonplan.runtime.outside_inference import outside_inference
from moonplan.runtime.refill import check_target
from moonplan.stepcost import StepCost


class BetweenSteps(LayerResources):
    """Calibration, re-homing and refills of one layer, between its steps (a base of
    ``LayerRuntime``, which sets the attributes below in its constructor)."""

    config: MoEConfig
    balancer: Balancer
    label_E: Tensor | None  # model id -> label (None: the identity)
    window: LoadWindow  # recent loads, by label
    serving: bool  # no step ran with autograd on (auto's own re-home waits for it)
    rehome_judged: bool  # auto's own re-home while serving was judged (it is, once)
    own_move_bytes: float  # what a training re-home would move here per byte of weights
    move_bytes: float  # the same, agreed by every rank (0: none offered)
    last_plan: Plan | None
    published_version: tuple[int, ...]

    @outside_inference()
    def calibrate(self) -> StepCost:
        """Collective: a :class:`StepCost` from this layer's measured steps, agreed across
        ranks (element-wise max, then checked like the config: every value the same on
        every rank, or the same ``ContractError`` everywhere); ``balance="auto"`` plans
        with it from the next step."""
        self._lane.drain()
        home = {name: self.store.local[name][: self.M] for name in self.store.local}
        cost = self.balancer.calibrate(
            self.group,
            copy_fallback_s=time_local_copy(home),
            overlap=self.lane().kind != "inline",
        )
        self.group.check_settings("calibrated cost", cost_settings(cost))
        return cost

    @outside_inference()
    def set_cost(self, cost: StepCost) -> None:
        """Collective: plan ``balance="auto"`` with ``cost`` from the next step on (as
        ``MoEConfig.cost`` would have: no calibration). Agreed like the config: a
        ``cost`` that is not a :class:`StepCost` on some rank (``TypeError`` where on
        every rank), or values that differ, raise the same error on every rank and
        change nothing.
        """
        if not isinstance(cost, StepCost):
            bad = TypeError(f"cost must be a moonplan.stepcost.StepCost, got {cost!r}")
            self.group.fail_settings("cost", bad)
        self.group.check_settings("cost", cost_settings(cost))
        self._lane.drain()
        self.config = self.config.replace(cost=cost)
        self.balancer = layer_balancer(self.config, self.B)

    def auto_cost(self) -> StepCost | None:
        """The cost model ``auto`` plans with (``None`` before calibration or in another
        mode)."""
        return self.balancer.cost if self.balancer.policy() == "auto" else None

    def rehome_due(self) -> bool:
        """Whether this step begins with ``balance="auto"``'s own re-home while serving
        (``MoEConfig.rehome``): once, at the first step after the window of loads first
        fills, with a cost model, where every step so far ran with autograd off on every
        rank (serving: no optimizer state to leave behind). The front end asks before it
        reads its parameters (:meth:`ShardedExperts.step_begins
        <moonplan.core.sharded.ShardedExperts.step_begins>`). Every input is agreed, so
        every rank answers alike. In training the placer's decisions offer re-homes
        instead (:meth:`take_home_offer`)."""
        return (
            self.config.balancing.rehome
            and self.serving
            and not self.rehome_judged
            and self.window.filled == self.window.W
            and self.auto_cost() is not None
        )

    def take_home_offer(self) -> HomeOffer | None:
        """The re-home the placer's decisions offered in training (rent or buy:
        ``Residency``), in labels (``HomeOffer.perm_E``: new label ``j`` is old label
        ``perm_E[j]``), once: ``None`` if none waits. Every rank's decisions offer it at
        the same step."""
        return self.placer.take_home()

    def recent_loads(self) -> Tensor:
        """int64 ``[E]``: records per *model* expert over the last ``WINDOW`` steps (all
        ranks; the same on every rank), a profile for
        :func:`~moonplan.plan.home_order.popular_order`."""
        totals_E = self.window.totals_E()  # by label
        return totals_E if self.label_E is None else totals_E[self.label_E]

    @outside_inference()
    def rehome(
        self, cfg: MoEConfig, move: Callable[[], None], judged: HomeOffer | None = None
    ) -> None:
        """Take ``cfg``'s home order, the front end's ``move`` (collective) carrying the
        home rows there (:meth:`ShardedExperts.rehome
        <moonplan.core.sharded.ShardedExperts.rehome>`); ``judged``: the judgement that
        chose it (its steps are served its way until the placer's next decision).

        First the background lane drains (a replica-gradient reduce may still write
        gradients) and any refill is dropped; the placer takes the new labels
        (``Placer.relabel``: its window's loads stay, relabelled; a decision or refill
        in the old labels is dropped). Then ``move`` runs and the layer takes the new
        labels: the slots are empty, the window is relabelled, the weights republish
        before the next step, ``last_plan`` is ``None``.
        """
        self._lane.drain()
        self.refill.drop()
        new = cfg.sizes.home_order or range(self.E)  # model expert of each new label
        columns_E = torch.tensor(list(new), dtype=torch.int64, device=self.group.device)
        if self.label_E is not None:  # old label of each new one
            columns_E = self.label_E[columns_E]
        self.placer.relabel(self.store.pool, self.refill, columns_E, judged)
        move()
        self.config, self.label_E = cfg, home_labels(cfg, self.group.device)
        self.window.relabel(columns_E)
        self.weights_changed()
        self.last_plan = None

    def weights_changed(self) -> None:
        """Home weights changed: republish them before the next step; every slot is stale.

        In-place updates of the expert parameters (optimizer steps, ``copy_``) are
        detected by their version counters and shared with every rank in the counts
        exchange, so calling this is only needed after changes torch cannot see.
        """
        self.published, self.resident = False, None
        self.published_version = ()

    @outside_inference()
    def request_refill(self, target_RB: Tensor) -> None:
        """Collective: refill the resident slots with ``target_RB`` (int64 ``[R, B]`` expert
        labels, ``-1``: keep) beside the next steps; call it on every rank alike, between
        steps.

        The changed slots (``target[r][j] >= 0`` and not what the last plan holds there,
        at most ``S = refill_rows`` per rank) are copied from their experts' home rows into
        staging rows by a job on the background lane; the steps keep serving the old
        slots until every rank's copy is done, and the first step that sees that in its
        counts exchange puts them into the slots before it plans
        (:mod:`moonplan.runtime.refill`; docs/runtime.md, "Refilling slots in the
        background"). A failed copy on any rank, changed weights or a resync drop it on
        every rank. Nothing to change starts nothing. Two small all-gathers check the
        request (valid everywhere, the same target everywhere).

        Raises:
            ValueError: on every rank: ``target`` is not an integer ``[R, B]`` tensor of a
                valid slot table (a ``PlanError``), or changes more than ``S`` slots on a
                rank (each named).
            RuntimeError: on every rank: a refill is already in flight
                (:attr:`Refill.in_flight`; wait for its commit or drop), another layer's
                refill holds the shared staging rows (:mod:`moonplan.runtime.staging`), or
                the home
                weights are not published (no step since the layer was built or since
                :meth:`weights_changed`).
            ContractError: the ranks disagree (one rank's request is bad, or the targets
                differ), naming them.
        """
        R = self.group.size
        current = self.resident.slot_expert if self.resident is not None else None
        if current is None:
            current = empty_slots(R, self.B)
        try:
            changed = check_target(target_RB, current, num_experts=self.E, staging_rows=self.S)
            if self.refill.in_flight:
                raise RuntimeError("a refill is already in flight: wait for its commit or drop")
            if self.store.pool.held_by_other(self.refill):
                raise RuntimeError(
                    "another layer's refill holds the shared staging rows "
                    "(moonplan.runtime.staging): wait for its commit or drop"
                )
            if not self.published:
                raise RuntimeError("no published home weights to refill from: run a step first")
            err: Exception | None = None
        except (ValueError, RuntimeError) as exc:
            err = exc
        self.group.outcome("request_refill", err)
        target = target_RB.to("cpu", torch.int64)
        self.group.check_same("refill target", tuple(target.flatten().tolist()))
        collective = not self.store.transport.one_sided
        self.refill.start(
            target, changed, self.store.stage, self.lane(), pool=self.store.pool,
            collective=collective,
        )  # fmt: skip


MOVE_UNIT = 1024
"""Units of a byte per byte of weights in which ranks exchange ``own_move_bytes``
(:func:`move_word`): exact for the ratios of torch's dtypes (halves and quarters)."""


def move_word(ratio: float) -> int:
    """``ratio`` (bytes a re-home moves per byte of weights) as an int64 word of the counts
    exchange, in :data:`MOVE_UNIT`."""
    return round(ratio * MOVE_UNIT)


def agreed_move_bytes(words_R: list[int]) -> float:
    """The bytes a training re-home moves per byte of weights, from every rank's
    :func:`move_word` (the same list on every rank, so every rank answers or raises
    alike).

    Raises:
        ContractError: the ranks differ (their optimizers hold different state, or only
            some ranks' optimizers hold every expert tensor): a re-home would leave
            state behind on some ranks, or be taken on some only.
    """
    if len(set(words_R)) > 1:
        said = ", ".join(f"rank {r}: {w / MOVE_UNIT:g}" for r, w in enumerate(words_R))
        raise ContractError(
            "ranks' optimizers would move different bytes per byte of expert weights in a "
            f"re-home ({said}): give every rank the same optimizer over all of the "
            "layer's expert tensors, or set MoEConfig(rehome=False)"
        )
    return words_R[0] / MOVE_UNIT if words_R else 0.0
