"""The candidates ``policy="auto"`` chooses among, in tie-break order.

Legend: R ranks, E experts, K levels (:data:`LEVELS`), C = K + 4 candidates.

Every step ``auto`` scores all of them with the step-cost formula and takes the least
predicted step time; ties go to the earlier entry: static EP first (never a plan predicted
no faster than static EP), then ``exact`` (a candidate that plans the same allocation as
``exact`` is named ``exact``), then the others, fewer weight moves first. The table is
fixed by ``K`` alone (not by the counts), so the device planner's shapes depend only on
``(R, E, B)``.

* ``static``: every record on its expert's home rank (static EP);
* ``exact``: the group-flow construction towards the exact targets, ``previous``'s flows
  replayed and resident pairs preferred;
* ``resident``: balance through the replicas resident in ``previous``'s slots
  (:mod:`~moonplan.plan.choice.resident`: a diffusion of parallel rounds, no weight moves);
* ``level-k`` (``k = K-1 .. 1``): the construction towards ``water_fill(L, cap_k)``,
  ``cap_k`` the k-th of :func:`~moonplan.plan.choice.targets.level_caps`;
* ``greedy``: the construction towards the exact targets without ``previous`` (MoonEP's
  greedy allocation), its replicas reusing the residents;
* ``placed``: static EP over the slots: each expert's records all on one rank, the first
  (lowest) rank holding it in ``previous``'s slots, else its home. Whole experts moved
  into the slots, as EPLB moves them, served with a table lookup (no weight moves).

Without ``previous=`` the ``resident`` and ``placed`` plans are ``static`` and ``greedy`` is
``exact``: each ties the earlier one and never wins.
"""

from __future__ import annotations

from dataclasses import dataclass

LEVELS = 16
"""``K``: levels between exact balance (level 0) and static EP (level ``K``), one candidate
each, their caps ``(max L - m) / K`` records apart. Measured against 128 levels on the
sweep's presets (216 steps): the least predicted step time is on average 0.19% above it
(at most 2.6%) with 16 levels, 0.47% (12.6%) with 8, 0.09% (2.2%) with 32
(``docs/planner-policy.md``, "Levels")."""

KINDS = ("static", "resident", "level", "exact", "greedy", "placed")


@dataclass(frozen=True)
class Candidate:
    """One entry of the table: its name (``plan.policy`` when it wins), kind and level."""

    name: str
    kind: str
    level: int = 0

    @property
    def constructs(self) -> bool:
        """Whether it is built by its own run of the group-flow construction."""
        return self.kind in ("level", "exact", "greedy")


def table(levels: int = LEVELS) -> tuple[Candidate, ...]:
    """The ``levels + 4`` candidates in tie-break order (module docstring)."""
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be an integer >= 1, got {levels!r}")
    steps = tuple(Candidate(f"level-{k}", "level", k) for k in range(levels - 1, 0, -1))
    return (
        Candidate("static", "static"),
        Candidate("exact", "exact"),
        Candidate("resident", "resident"),
        *steps,
        Candidate("greedy", "greedy"),
        Candidate("placed", "placed"),
    )


RESIDENT = 2
"""The ``resident`` candidate's index in the table."""


def placed_index(levels: int = LEVELS) -> int:
    """The ``placed`` candidate's index in the table (the last)."""
    return levels + 3


def names(levels: int = LEVELS) -> tuple[str, ...]:
    """The candidates' names in table order."""
    return tuple(c.name for c in table(levels))


def parse_level(name: str, levels: int = LEVELS) -> int | None:
    """``k`` of ``"level-k"`` (``1 <= k < levels``), else ``None``."""
    if not name.startswith("level-") or not name[6:].isdigit():
        return None
    k = int(name[6:])
    return k if 1 <= k < levels and name == f"level-{k}" else None
