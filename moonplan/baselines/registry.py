"""The policy registry: every simulator policy registered once, with what reports need of it.

Legend:
    R ranks    E experts

A policy registers one :class:`PolicyInfo` next to its class (``register(PolicyInfo(...))``
at the bottom of its module): its name, the column label of the simulator's tables,
its line style in plots, its planning time per planner run, the options its builder
takes and the builder itself. Everything that lists or builds policies reads the
registry: :func:`make_policy`, :func:`names` (the default policy list of the simulator,
its CLI and benches), ``moonplan.simulate.report`` (labels), ``moonplan.simulate.plots``
(styles) and ``moonplan.simulate.model_time`` (planning times). Adding a policy is one
file and one registration (CONTRIBUTING.md, "Adding a planner policy").

The registry is the package's one piece of process-wide mutable state, by design:
it only grows at import time (``moonplan/baselines/__init__.py`` imports every
built-in policy module), refuses a second registration of a name, and
:func:`registered` adds a policy for the length of a ``with`` block (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from moonplan.baselines.policy_base import Policy

Builder = Callable[..., Policy]
"""``build(name, num_ranks, num_experts, **options) -> Policy`` (``options``: those the
policy declares, see :attr:`PolicyInfo.options`)."""


PlanUs = float | Callable[[int, int], float]
"""Microseconds of a planner call: fixed, or a function of ``(R, E)``."""


def plan_us_at(value: PlanUs, num_ranks: int, num_experts: int) -> float:
    """``value`` (:data:`PlanUs`) at ``(R, E)``."""
    return float(value(num_ranks, num_experts) if callable(value) else value)


@dataclass(frozen=True)
class PolicyInfo:
    """One registered policy (or, with ``family=True``, every name starting with ``name``).

    Attributes:
        name: the policy's name (``make_policy(name, ...)``); for a family, the prefix
            (``"capacity-"`` builds ``capacity-<f>``).
        build: ``build(name, num_ranks, num_experts, **options) -> Policy``.
        label: column header in the simulator's tables (default: the name).
        style: ``(line style, marker)`` of its line in the simulator's plots.
        plan_us: planning time per planner call on the critical path, microseconds
            (what ``SimConfig`` charges per ``PolicyStep.planned``; 0: plans nothing), or
            a function of ``(R, E)`` giving it (a device planner's time by shape).
        exit_us: the same for ``policy="auto"``'s early exit (``StepCost.exit_s``).
        round_us: device microseconds of one round of the ``resident`` candidate that
            exit builds (``StepCost.round_s``).
        decide_us: host microseconds per build a slot-placement decision counts
            (``StepCost.decide_s``), or a function of ``(R, E)`` giving it.
        score_us: host microseconds per (step, table) such a decision scores without a
            build (``StepCost.score_s``), or a function of ``(R, E)`` giving it.
        exact_us: microseconds of one ``policy="exact"`` call that the policy serves in
            place of its own (``StepCost.exact_s``), or a function of ``(R, E)``.
        options: keyword options of :func:`make_policy` the builder takes (others are
            dropped, so one option set serves every policy).
        order: position in :func:`names` (report order; ties keep registration order).
        listed: in :func:`names`, the simulator's default policies (a family is never).
        family: ``name`` is a prefix (see above).
    """

    name: str
    build: Builder
    label: str = ""
    style: tuple[str, str] = ("-", ".")
    plan_us: PlanUs = 0.0
    exit_us: PlanUs = 0.0
    round_us: float = 0.0
    decide_us: PlanUs = 0.0
    score_us: PlanUs = 0.0
    exact_us: PlanUs = 0.0
    options: tuple[str, ...] = ()
    order: int = 1000
    listed: bool = True
    family: bool = False

    def header(self, name: str) -> str:
        """The table label of ``name`` (a family member: its own name)."""
        return name if self.family or not self.label else self.label


class PolicyRegistry:
    """Name -> :class:`PolicyInfo`, in registration order (see the module docstring)."""

    def __init__(self) -> None:
        self._infos: dict[str, PolicyInfo] = {}

    def register(self, policy: PolicyInfo) -> PolicyInfo:
        """Add ``policy``; a name already registered is refused (``ValueError``)."""
        if not policy.name:
            raise ValueError("a policy needs a name")
        if policy.name in self._infos:
            raise ValueError(f"policy {policy.name!r} is already registered")
        self._infos[policy.name] = policy
        return policy

    def unregister(self, name: str) -> None:
        """Remove ``name`` (``KeyError`` if it is not registered)."""
        del self._infos[name]

    def infos(self) -> dict[str, PolicyInfo]:
        """Every registration (families included), by name, in registration order (a copy)."""
        return dict(self._infos)

    def names(self) -> tuple[str, ...]:
        """Listed policy names in report order."""
        listed = [p for p in self._infos.values() if p.listed and not p.family]
        return tuple(p.name for p in sorted(listed, key=lambda p: p.order))

    def info(self, name: str) -> PolicyInfo:
        """The :class:`PolicyInfo` of ``name`` (exact name, else the family it starts with)."""
        if name in self._infos:
            return self._infos[name]
        for p in self._infos.values():
            if p.family and name.startswith(p.name):
                return p
        choices = [*self.names(), *(f"{p.name}<...>" for p in self._infos.values() if p.family)]
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(choices)}")

    def make(self, name: str, num_ranks: int, num_experts: int, **options: Any) -> Policy:
        """Build ``name`` for ``R`` ranks and ``E`` experts (see :func:`make_policy`)."""
        p = self.info(name)
        taken = {k: v for k, v in options.items() if k in p.options}
        return p.build(name, num_ranks, num_experts, **taken)


REGISTRY = PolicyRegistry()
"""The process-wide registry (built-in policies register on import of ``moonplan.baselines``)."""


def register(policy: PolicyInfo) -> PolicyInfo:
    """Register ``policy`` in :data:`REGISTRY` (once per name); returns it."""
    return REGISTRY.register(policy)


@contextmanager
def registered(policy: PolicyInfo) -> Iterator[PolicyInfo]:
    """Register ``policy`` for the length of a ``with`` block (a test's toy policy)."""
    REGISTRY.register(policy)
    try:
        yield policy
    finally:
        REGISTRY.unregister(policy.name)


def make_policy(name: str, num_ranks: int, num_experts: int, **options: Any) -> Policy:
    """Build a registered policy by name (see :func:`names`).

    ``capacity-<f>`` accepts any factor ``f > 0`` (e.g. ``capacity-2.0``). ``options`` go
    to the policies that declare them (EPLB: ``redundant``, ``period``, ``window``,
    ``nodes``, ``groups``; moonplan: ``slots``; ``moonplan-auto`` also needs ``cost``, a
    :class:`~moonplan.stepcost.StepCost`); options a policy does not take are ignored.
    """
    return REGISTRY.make(name, num_ranks, num_experts, **options)


def names() -> tuple[str, ...]:
    """Names of the listed policies, in report order (the simulator's default set)."""
    return REGISTRY.names()


def infos() -> dict[str, PolicyInfo]:
    """Every registration by name (families included; a copy)."""
    return REGISTRY.infos()


def info(name: str) -> PolicyInfo:
    """The registration of ``name`` (``ValueError`` naming the choices if there is none)."""
    return REGISTRY.info(name)
