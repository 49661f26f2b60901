"""``slots=``: counts, byte budgets and fractions; the small default; direct reads reported."""

from __future__ import annotations

import pytest
import torch

from moonplan.runtime.slot_budget import (
    DEFAULT_SLOTS,
    Bytes,
    default_slots,
    expert_bytes,
    parse_bytes,
    resolve_rows,
    resolve_slots,
)
from moonplan.testing.dist import run_ranks


def _resolve(slots, E=16, R=4, H=8, F=16, dtype=torch.float32) -> int:
    return resolve_slots(slots, num_experts=E, ranks=R, hidden=H, ffn=F, dtype=dtype)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2GiB", 2 << 30),
        ("512 MiB", 512 << 20),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        ("10kb", 10_000),
        ("3KiB", 3072),
        ("1e3B", 1000),
    ],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "2 GiBs", "-1MiB", "two", "1.2.3GB"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(text)


def test_counts_budgets_and_fractions() -> None:
    one = expert_bytes(8, 16, torch.float32)
    assert one == 3 * 8 * 16 * 4
    assert _resolve(3) == 3 and _resolve(0) == 0
    assert _resolve(Bytes(5 * one)) == 5 and _resolve(Bytes(5 * one - 1)) == 4
    assert _resolve(f"{5 * one}B") == 5
    assert _resolve(0.5) == 2 and _resolve(1.0) == 4 and _resolve(0.0) == 0  # M = 4
    assert _resolve(Bytes(10**9)) == 16 and _resolve(100.0) == 16  # capped at E
    assert _resolve(Bytes(5 * one), dtype=torch.bfloat16) == 10  # half the bytes per expert
    assert _resolve(None) == default_slots(16, 4) == min(DEFAULT_SLOTS, 4)
    assert default_slots(3, 2) == min(DEFAULT_SLOTS, 2)


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), True, [2], "2 parsecs"])
def test_bad_slots_raise(bad) -> None:
    with pytest.raises(ValueError):
        _resolve(bad)
    with pytest.raises(ValueError):
        Bytes(-1)


@pytest.mark.parametrize("slots", [17, 10**6, 10**30, Bytes(10**30), "1e30", "1e300 kB", 1e308])
def test_every_form_is_capped_at_the_experts(slots) -> None:
    assert _resolve(slots) == 16  # E: no slots= value reserves more than E experts per rank


@pytest.mark.parametrize("text", ["1e400", "1e400 GiB", "1e300 TiB"])
def test_sizes_beyond_a_float_are_refused_naming_slots(text: str) -> None:
    with pytest.raises(ValueError, match=r"^slots: cannot read a byte size .*not a finite"):
        _resolve(text)


def test_layer_takes_a_budget() -> None:
    from moonplan import MoonMoE

    one = expert_bytes(8, 12, torch.float32)
    # a budget of 3 rows: 3 slots, and 1 staging row on top, shared by every layer of these
    # shapes on the device (refill_rows=1, the default)
    layer = MoonMoE(8, 12, 6, 2, slots=f"{3 * one}B", balance="exact")
    assert (layer.slots, layer.runtime.S) == (3, 1)
    layer = MoonMoE(8, 12, 6, 2, slots=f"{3 * one}B", balance="exact", refill_rows=0)
    assert (layer.slots, layer.runtime.S) == (3, 0)
    assert MoonMoE(8, 12, 6, 2, slots=0.5, balance="exact").slots == 3  # one rank: M = 6
    layer = MoonMoE(8, 12, 6, 2, balance="exact")
    assert (layer.slots, layer.runtime.S) == (min(DEFAULT_SLOTS, 6), 1)  # a count: on top


def test_refill_rows_come_on_top_of_the_slots() -> None:
    kw = {"num_experts": 6, "ranks": 2, "hidden": 8, "ffn": 12, "dtype": torch.float32}
    one = expert_bytes(8, 12, torch.float32)
    assert resolve_rows(2, 1, **kw) == (2, 1)  # a count keeps its slots
    assert resolve_rows(2, 5, **kw) == (2, 2)  # staging rows never outnumber the slots
    assert resolve_rows(0, 1, **kw) == (0, 0)  # no slots: nothing to refill
    assert resolve_rows(None, 1, **kw) == (2, 1)
    assert resolve_rows(Bytes(5 * one), 1, **kw) == (5, 1)  # a budget buys slots only
    assert resolve_rows(Bytes(5 * one), 3, **kw) == (5, 3)
    assert resolve_rows(Bytes(one), 1, **kw) == (1, 1)
    assert resolve_rows(f"{one // 2}B", 1, **kw) == (0, 0)
    assert resolve_rows(1.0, 1, **kw) == (3, 1)  # M = 3 rows
    assert resolve_rows(1e308, 1, **kw) == (6, 1)  # capped at E slots
    assert resolve_rows(Bytes(100 * one), 2, **kw) == (6, 2)
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="refill_rows must be an int >= 0"):
            resolve_rows(2, bad, **kw)  # type: ignore[arg-type]


def _direct(rank: int, world: int, slots: int) -> list[int]:
    from moonplan import MoonMoE

    def hot(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(x.shape[0], 1, dtype=torch.int64)  # every record on expert 0
        return ids, torch.ones(x.shape[0], 1) + 0 * x.sum()

    layer = MoonMoE(8, 8, 4, 1, slots=slots, router=hot, balance="exact")
    with torch.no_grad():
        layer(torch.randn(12, 8))
    s = layer.last_stats
    assert s is not None and s.policy == "exact"
    return [s.direct_reads, s.prefetched_rows]


def test_direct_reads_are_reported_per_step() -> None:
    """Expert 0 takes every record: each of the 3 other ranks runs a replica of it, in a
    slot (prefetched) or, without slots, read directly from rank 0."""
    none = run_ranks(_direct, 4, 0, timeout=60)
    assert [d for d, _ in none] == [0, 1, 1, 1] and all(p == 0 for _, p in none)
    slotted = run_ranks(_direct, 4, 1, timeout=60)
    assert [d for d, _ in slotted] == [0, 0, 0, 0] and [p for _, p in slotted] == [0, 1, 1, 1]
