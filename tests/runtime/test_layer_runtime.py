"""``LayerRuntime`` construction: one agreement of every setting that shapes a step, and
bounded buffers, before any step and any collective allocation.

Legend: R ranks, E experts, H hidden, F expert FFN size, K top-k.

Fault injection: each rank builds layers from its own options and environment (one rank
``balance="exact"``, another ``"off"``; ``LOCAL_WORLD_SIZE`` 2,2,4,4 and 1,2,2,2 on 4
ranks; ``max_tokens`` 1 vs 4096 on the all-to-all; dtypes on the heap; cost models;
an option that only one rank cannot use). Every rank must raise the same error, naming
each differing setting with its value per rank, within seconds; the group is still in
step afterwards (the next case runs on the same ranks).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from moonplan.stepcost import StepCost
from moonplan.testing.dist import run_ranks

pytestmark = pytest.mark.distributed

H, F, E, K = 8, 12, 8, 2
TIMEOUT = 60.0
FAST_S = 10.0  # "within seconds": every case raises well before the group timeout

Case = tuple[dict[str, list[Any]], dict[str, list[str]]]  # per-rank options, environment


def _cost(copy_s: float = 1e-3) -> StepCost:
    return StepCost(1e-6, 0.0, 0.0, copy_s, copy_s, 0.0, 0.0, 0.0, 0.0)


def _build_each(rank: int, world: int, cases: list[Case]) -> list[tuple[str, str, float]]:
    """Build a MoonMoE for each case with this rank's options and environment; the
    error each raised (type, message) and how long it took."""
    from moonplan import MoonMoE

    out = []
    for options, env in cases:
        for name, values in env.items():
            os.environ[name] = values[rank]
        mine = {name: values[rank] for name, values in options.items()}
        t0 = time.perf_counter()
        try:
            layer = MoonMoE(H, F, E, K, **mine)
            layer(torch.randn(3, H, dtype=layer.config.dtype))  # a step runs: all agreed
            out.append(("", "", time.perf_counter() - t0))
        except Exception as exc:
            out.append((type(exc).__name__, str(exc), time.perf_counter() - t0))
        for name in env:
            del os.environ[name]
    return out


def _same_everywhere(got: list[list[tuple[str, str, float]]], case: int) -> tuple[str, str]:
    """The one (type, message) every rank raised for ``case``, checked fast."""
    errors = {(r[case][0], r[case][1]) for r in got}
    assert len(errors) == 1, errors
    assert all(r[case][2] < FAST_S for r in got), [r[case][2] for r in got]
    return errors.pop()


MISMATCHES_2: list[tuple[Case, list[str]]] = [
    (({"balance": ["exact", "off"]}, {}), ["balance (rank 0: 'exact'; rank 1: 'off')"]),
    (({"balance": ["exact", "auto"]}, {}), ["balance (rank 0: 'exact'; rank 1: 'auto')"]),
    (
        ({"max_tokens": [1, 4096], "transport": ["a2a", "a2a"]}, {}),
        ["max_tokens (rank 0: 1; rank 1: 4096)"],
    ),
    (
        ({"dtype": [torch.float32, torch.float64], "transport": ["heap", "heap"]}, {}),
        ["dtype (rank 0: torch.float32; rank 1: torch.float64)"],
    ),
    (
        ({"cost": [_cost(1e-3), _cost(2e-3)]}, {}),
        ["cost.copy_s_intra (rank 0: 0.001; rank 1: 0.002)", "cost.copy_s_inter"],
    ),
    (({"cost": [_cost(), None]}, {}), ["cost (rank 0: 'StepCost'; rank 1: None)"]),
    # 4 KiB // (3HF*4) = 3 slots (the refill staging row comes on top)
    (({"slots": [1, "4KiB"]}, {}), ["slots (rank 0: 1; rank 1: 3)"]),
    (({"refill_rows": [1, 0]}, {}), ["refill_rows (rank 0: 1; rank 1: 0)"]),
    (
        ({"overlap": [True, False], "align": [1, 4]}, {}),
        ["in 2 settings", "align (rank 0: 1; rank 1: 4)", "overlap (rank 0: True; rank 1: False)"],
    ),
    (
        ({"slots": ["1e400", 2]}, {}),  # only rank 0 cannot read its option
        ["MoonMoE config: contract violated on rank 0", "slots: cannot read a byte size"],
    ),
]


def test_settings_that_differ_raise_the_same_error_on_every_rank_naming_them() -> None:
    cases = [case for case, _ in MISMATCHES_2] + [({"balance": ["off", "off"]}, {})]
    got = run_ranks(_build_each, 2, cases, timeout=TIMEOUT)
    for i, (_, words) in enumerate(MISMATCHES_2):
        kind, message = _same_everywhere(got, i)
        assert kind == "ContractError", (i, message)
        for w in words:
            assert w in message, (w, message)
    assert _same_everywhere(got, len(MISMATCHES_2)) == ("", "")  # the group is in step


def test_ranks_per_host_from_the_environment_is_agreed() -> None:
    hosts = {"transport": ["a2a-hosts"] * 4}
    cases: list[Case] = [
        (hosts, {"LOCAL_WORLD_SIZE": ["2", "2", "4", "4"]}),
        (hosts, {"LOCAL_WORLD_SIZE": ["1", "2", "2", "2"]}),
        (hosts, {"LOCAL_WORLD_SIZE": ["3", "2", "2", "2"]}),  # rank 0's does not divide 4
        (hosts, {"LOCAL_WORLD_SIZE": ["2", "2", "2", "2"]}),
        ({"transport": ["a2a"] * 4}, {"LOCAL_WORLD_SIZE": ["1", "2", "2", "2"]}),  # unread
    ]
    got = run_ranks(_build_each, 4, cases, timeout=TIMEOUT)
    kind, message = _same_everywhere(got, 0)
    assert kind == "ContractError"
    assert "ranks_per_host (LOCAL_WORLD_SIZE) (rank 0, 1: 2; rank 2, 3: 4)" in message
    kind, message = _same_everywhere(got, 1)
    assert "ranks_per_host (LOCAL_WORLD_SIZE) (rank 0: 1; rank 1, 2, 3: 2)" in message
    kind, message = _same_everywhere(got, 2)
    assert kind == "ContractError" and "rank 0: ValueError: LOCAL_WORLD_SIZE must divide" in message
    assert _same_everywhere(got, 3) == ("", "")
    assert _same_everywhere(got, 4) == ("", "")


def test_an_invalid_option_on_every_rank_raises_its_own_error_everywhere() -> None:
    """Every rank failing alike: the user's own error (type and message), not a wrapped one."""
    got = run_ranks(_build_each, 2, [({"slots": [-1, -1]}, {})], timeout=TIMEOUT)
    assert _same_everywhere(got, 0) == ("ValueError", "slots must be >= 0, got -1")


def _cost_changes(rank: int, world: int) -> dict[str, Any]:
    from moonplan import MoonMoE

    layer = MoonMoE(H, F, E, K, balance="auto", transport="a2a")
    out: dict[str, Any] = {}
    for name, cost in (("differs", _cost(1e-3 * (rank + 1))), ("bad", None if rank else 1.0)):
        try:
            layer.set_cost(cost)  # type: ignore[arg-type]
        except Exception as exc:
            out[name] = (type(exc).__name__, str(exc))
    assert layer.cost is None  # a refused cost changes nothing
    layer.set_cost(_cost())
    y = layer(torch.randn(5, H))
    shown = layer.config.balancing.cost == layer.experts.config.balancing.cost == _cost()
    out["set"] = (layer.cost == _cost(), shown, bool(torch.isfinite(y).all()))
    auto = MoonMoE(H, F, E, K, balance="auto", transport="a2a")
    for _ in range(6):  # warm-up steps, then the automatic calibration
        auto(torch.randn(6, H))
    out["calibrated"] = auto.cost.as_tensor().tolist() if auto.cost is not None else None
    out["decide_s"] = auto.cost.decide_s if auto.cost is not None else None
    out["score_s"] = auto.cost.score_s if auto.cost is not None else None
    return out


def test_a_new_cost_and_a_calibration_are_agreed() -> None:
    got = run_ranks(_cost_changes, 2, timeout=TIMEOUT)
    for key in ("differs", "bad"):
        assert got[0][key] == got[1][key], key
    assert got[0]["differs"][0] == "ContractError"
    assert "cost.copy_s_intra (rank 0: 0.001; rank 1: 0.002)" in got[0]["differs"][1]
    assert got[0]["bad"][0] == "ContractError"
    assert "rank 0: TypeError: cost must be a moonplan.stepcost.StepCost" in got[0]["bad"][1]
    assert got[0]["set"] == got[1]["set"] == (True, True, True)  # the config shows it
    assert got[0]["calibrated"] is not None and got[0]["calibrated"] == got[1]["calibrated"]
    assert got[0]["decide_s"] > 0 and got[0]["score_s"] > 0  # the placement's host rates


def _bounded(rank: int, world: int) -> dict[str, Any]:
    from moonplan import MoonMoE

    out: dict[str, Any] = {}
    for transport in ("heap", "a2a"):
        for slots in (10**6, 10**30, 1e308):
            layer = MoonMoE(H, F, E, K, slots=slots, transport=transport, balance="exact")
            layer(torch.randn(4, H))
            heap = layer.runtime.heap
            out[(transport, slots)] = (layer.slots, heap.nbytes if heap is not None else 0)
            layer.runtime.close()
    t0 = time.perf_counter()
    try:
        MoonMoE(H, F, E, K, max_tokens=10**13, transport="a2a")
    except Exception as exc:
        out["max_tokens"] = (type(exc).__name__, str(exc), time.perf_counter() - t0)
    return out


def test_sizes_are_capped_or_refused_before_any_allocation() -> None:
    got = run_ranks(_bounded, 2, timeout=TIMEOUT)
    small = got[0][("heap", 10**6)][1]
    for key in [(t, s) for t in ("heap", "a2a") for s in (10**6, 10**30, 1e308)]:
        assert got[0][key][0] == E, key  # capped at E, as documented
        assert got[0][key][1] == small or key[0] == "a2a"
    assert small < 1 << 20  # a few experts' weights, not gigabytes
    kind, message, took = got[0]["max_tokens"]
    assert got[1]["max_tokens"][:2] == (kind, message)
    assert kind == "ContractError" and took < FAST_S
    assert "max_tokens=10000000000000 x top_k=2" in message and "above the limit of" in message


def _growth_beyond_the_limit(rank: int, world: int) -> dict[str, Any]:
    from moonplan import MoonMoE
    from moonplan.runtime import buffers

    layer = MoonMoE(H, F, E, K, max_tokens=4, transport="a2a", balance="exact")
    built = layer.runtime.capacity
    limit = buffers.BufferSpec("a2a", E, layer.slots, 4, H, F, torch.float32).heap_bytes(built)
    buffers.memory_bytes = lambda device: limit  # this forked rank only: a small device
    out: dict[str, Any] = {}
    try:
        layer(torch.randn(64, H))  # needs more receive rows than the limit allows
    except Exception as exc:
        out["error"] = (type(exc).__name__, str(exc))
    y = layer(torch.randn(2, H))  # the old buffers still serve a small step
    out["after"] = (layer.runtime.capacity == built, bool(torch.isfinite(y).all()))
    return out


def test_growth_beyond_the_device_memory_is_refused_everywhere() -> None:
    got = run_ranks(_growth_beyond_the_limit, 2, timeout=TIMEOUT)
    assert got[0]["error"] == got[1]["error"]
    kind, message = got[0]["error"]
    assert kind == "ContractError" and "this step's plan needs" in message
    assert "above the limit of" in message and "this rank's cpu memory" in message
    assert got[0]["after"] == got[1]["after"] == (True, True)
