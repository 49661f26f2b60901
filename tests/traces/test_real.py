"""``moonplan.traces.real``: the shipped traces, their statistics and the default split.

Legend: T steps, R ranks (8), E experts (64).
"""

from __future__ import annotations

import statistics

import pytest

from moonplan.traces.persistence import PERSISTENT_SHARE, trace_stats
from moonplan.traces.real import DATA, KINDS, index, real_trace, real_traces, trace_names


def test_twelve_small_traces_are_shipped() -> None:
    names = trace_names()
    assert names == sorted(f"{k}-l{layer}" for k in KINDS for layer in range(4))
    assert sum(p.stat().st_size for p in DATA.iterdir()) <= 5 * 2**20
    traces = real_traces(("decode",))
    assert sorted(traces) == [f"decode-l{layer}" for layer in range(4)]
    for c in traces.values():
        assert c.shape == (1100, 8, 64) and int(c.sum(2).min()) == int(c.sum(2).max()) == 128
    with pytest.raises(ValueError, match="no shipped trace"):
        real_trace("decode-l9")
    with pytest.raises(ValueError, match="kinds"):
        trace_names(("serving",))


@pytest.mark.parametrize("name", ["train-l2", "decode-l0", "prefill-l3"])
def test_the_index_holds_each_traces_statistics(name: str) -> None:
    """``index.json`` says what ``trace_stats`` measures on the shipped file: integers
    exactly, floats to 1e-12 relative (their last bits follow the machine's numpy: a
    variance split differed in the 16th digit between two x86 hosts)."""
    _same(index()["traces"][name], trace_stats(real_trace(name)))


def _same(want: object, got: object) -> None:
    if isinstance(want, dict) and isinstance(got, dict):
        assert want.keys() == got.keys()
        for k in want:
            _same(want[k], got[k])
    elif isinstance(want, float) or isinstance(got, float):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    else:
        assert want == got


def test_the_default_split_is_the_measured_median() -> None:
    shares = [t["split"]["share"] for t in index()["traces"].values()]
    assert len(shares) == 12
    assert PERSISTENT_SHARE == pytest.approx(statistics.median(shares), abs=5e-4)
