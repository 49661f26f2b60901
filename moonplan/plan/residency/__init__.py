"""Replicas that stay: slots placed from a window of recent loads and refilled beside the
steps (``docs/planner-policy.md``, "Replicas that stay").

Legend: R ranks, E experts, B slots per rank, W window steps.

* :mod:`~moonplan.plan.residency.serving`: the plan whose slots a refill leaves resident;
* :mod:`~moonplan.plan.residency.window`: the per-expert loads of the last ``W`` steps;
* :mod:`~moonplan.plan.residency.target`: which experts the slots should hold;
* :mod:`~moonplan.plan.residency.refill`: when a refill pays (rent or buy) and the
  :class:`Residency` that the runtime and the simulator both run.
"""
