"""``ExpertStore.prefetch`` on real process groups: new slots and direct rows hold the
home ranks' weights, resident slots are left alone, on the heap and the all-to-all.

Legend: R ranks, E experts, M = ceil(E/R), B slots, H hidden, F ffn, D direct rows.
"""

from __future__ import annotations

import pytest
import torch

from moonplan.testing.dist import run_ranks
from tests.runtime.oracle import dense_weights

pytestmark = pytest.mark.distributed

E, B, H, F = 7, 1, 4, 3
SENTINEL = -7.0


def _copies(rank: int, world: int, kind: str) -> list[dict]:
    """Per step: what ``rank``'s store copied and what its slots and direct rows hold."""
    import moonplan
    from moonplan.comm.group import EPGroup
    from moonplan.plan.home import home_start, max_local
    from moonplan.runtime.buffers import BufferSpec, build_buffers
    from moonplan.runtime.fetch_list import fetch_list

    group = EPGroup()
    M = max_local(E, world)
    store = build_buffers(group, BufferSpec(kind, E, B, M, H, F, torch.float32), 64).store
    w = dense_weights(E, H, F, seed=5)
    lo, hi = home_start(rank, E, world), home_start(rank + 1, E, world)
    store.publish_home({n: w[n][lo:hi] for n in ("gate_up", "down")})
    hot = torch.zeros(world, E, dtype=torch.int64)
    for i, e in enumerate((3, 4, 5, 6)):  # hot experts of ranks 1 and 2: more replicas
        hot[:, e] = 30 - 3 * i  # than one slot holds, so some are read directly
    steps, previous = [], None
    for counts_RE in (hot, hot, hot.roll(2, 1)):  # new slots, all resident, new again
        plan = moonplan.plan(counts_RE, slots=B, previous=previous)
        for name in ("gate_up", "down"):
            store.slots(name).fill_(SENTINEL)  # what prefetch does not write stays so
        copies = fetch_list(plan, rank, store.home)
        run = copies.mine if store.transport.one_sided else copies.group
        filled, direct = store.prefetch(copies) if run else store.no_fetch()
        steps.append(
            {
                "filled": filled,
                "new_B": plan.slot_new[rank].tolist(),
                "slot_B": plan.slot_expert[rank].tolist(),
                "direct_D": [e for e in plan.direct_expert()[rank].tolist() if e >= 0],
                "slots": {n: store.slots(n).clone() for n in ("gate_up", "down")},
                "direct": {n: t.clone() for n, t in direct.items()},
            }
        )
        previous = plan
    return steps


@pytest.mark.parametrize("kind", ["heap", "a2a"])
def test_prefetch_fills_new_slots_and_reads_direct_rows_from_home(kind) -> None:
    got = run_ranks(_copies, 3, kind, timeout=60)
    w = dense_weights(E, H, F, seed=5)
    moved = direct_rows = 0
    for steps in got:
        for s in steps:
            assert s["filled"] == sum(s["new_B"])
            for name in ("gate_up", "down"):
                for b, (new, e) in enumerate(zip(s["new_B"], s["slot_B"], strict=True)):
                    want = w[name][e] if new else torch.full_like(w[name][0], SENTINEL)
                    assert torch.equal(s["slots"][name][b], want), (name, b)
                assert s["direct"][name].shape == (len(s["direct_D"]), *w[name].shape[1:])
                for d, e in enumerate(s["direct_D"]):
                    assert torch.equal(s["direct"][name][d], w[name][e])
            moved += s["filled"]
            direct_rows += len(s["direct_D"])
    assert moved > 0 and direct_rows > 0  # both paths exercised
    assert all(steps[1]["filled"] == 0 for steps in got)  # residents are not copied again
