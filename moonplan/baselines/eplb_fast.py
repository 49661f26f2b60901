"""``eplb-fast``: EPLB re-placing every 4 steps from the last 4, its moves charged like a fetch.

Legend: R ranks, E experts.

The same algorithm and schedule as ``moonplan.baselines.eplb`` (``EPLBPolicy``), with
``window = period = 4`` and ``spread = 1``: each rearrangement's weight moves are copied
beside the one step after it and the new placement serves from the step after that. The
simulator charges those moves as moonplan's background copies are charged: their link
time alone on the links, hidden only behind the experts phase of the step they run
beside (the links carry no dispatch or combine then), the rest added to the step
(``moonplan.simulate.model_time``). No deployment runs EPLB this often; the model says
what tracking the routing step by step would cost EPLB if its moves were paid for.
"""

from __future__ import annotations

from typing import Any

from moonplan.baselines.eplb import EPLBPolicy
from moonplan.baselines.registry import PolicyInfo, register

FAST_PERIOD = 4
"""Steps between rearrangements and steps averaged (the earlier simulator's EPLB)."""


class EPLBFastPolicy(EPLBPolicy):
    """:class:`EPLBPolicy` with ``window = period = FAST_PERIOD`` and ``spread = 1``;
    ``settings``: ``redundant``, ``slots``, ``first``, ``nodes``, ``groups``."""

    name = "eplb-fast"

    def __init__(self, num_ranks: int, num_experts: int, **settings: Any) -> None:
        super().__init__(
            num_ranks, num_experts, period=FAST_PERIOD, window=FAST_PERIOD, spread=1, **settings
        )


def _build(name: str, num_ranks: int, num_experts: int, **settings: Any) -> EPLBFastPolicy:
    given = {k: v for k, v in settings.items() if v is not None}
    return EPLBFastPolicy(num_ranks, num_experts, **given)


register(PolicyInfo("eplb-fast", _build, style=("--", "x"), order=45,
                    options=("redundant", "slots", "nodes", "groups", "stale_slots")))  # fmt: skip
