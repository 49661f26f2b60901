"""Counts for the simulator: drifting traces, inclusion probabilities, MaxVio targets."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from moonplan.simulate.workload import (
    drifting_counts,
    drifting_popularity,
    inclusion_probability,
    popularity_maxvio,
    recorded_counts,
    sigma_for_maxvio,
)


@pytest.mark.parametrize("exact", [False, True])
def test_drifting_counts_shapes_sums_and_determinism(exact: bool) -> None:
    c = drifting_counts(3, 10, 50, 2, sigma=1.0, steps=4, seed=5, exact=exact)
    assert c.shape == (4, 3, 10) and c.dtype == torch.int64
    assert (c.sum(2) == 100).all()
    assert torch.equal(c, drifting_counts(3, 10, 50, 2, sigma=1.0, steps=4, seed=5, exact=exact))
    if exact:
        assert int(c.max()) <= 50  # a token picks an expert at most once
    with pytest.raises(ValueError):
        drifting_counts(3, 10, 50, 2, sigma=-1.0, steps=4)


def test_inclusion_probability() -> None:
    q = inclusion_probability(torch.full((8,), 1 / 8, dtype=torch.float64), 2)
    assert q.tolist() == pytest.approx([0.25] * 8)
    skew = inclusion_probability(torch.tensor([0.9, 0.05, 0.03, 0.02], dtype=torch.float64), 2)
    assert float(skew.sum()) == pytest.approx(2.0) and float(skew.max()) <= 1.0
    assert inclusion_probability(torch.tensor([0.5, 0.5, 0.0]), 2).tolist() == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError):
        inclusion_probability(torch.tensor([1.0, 0.0]), 2)


def test_sigma_for_maxvio_round_trip() -> None:
    assert popularity_maxvio(0.0, 16) == pytest.approx(0.0)
    sigma = sigma_for_maxvio(1.5, 64, 4, seed=3)
    assert popularity_maxvio(sigma, 64, seed=3) == pytest.approx(1.5, rel=1e-6)
    assert sigma_for_maxvio(0.0, 64, 4) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="unreachable"):
        sigma_for_maxvio(15.0, 64, 4)  # top-4 caps MaxVio below 64/4 - 1 = 15


def test_recorded_counts(tmp_path: Path) -> None:
    np.save(tmp_path / "one.npy", np.ones((2, 3), dtype=np.int64))
    assert recorded_counts(tmp_path / "one.npy").shape == (1, 2, 3)
    np.save(tmp_path / "trace.npy", np.ones((4, 2, 3), dtype=np.int64))
    assert recorded_counts(tmp_path / "trace.npy").shape == (4, 2, 3)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


@pytest.mark.parametrize(
    ("exact", "seed", "digest"),
    [
        (False, 0, "8f4d0bfadf0cfdda"),
        (False, 7, "6bec8dd7a3df4504"),
        (True, 0, "4053d5dc41755ae3"),
        (True, 7, "4a0a6b54d48d85de"),
    ],
)
def test_drifting_counts_traces_are_unchanged(exact: bool, seed: int, digest: str) -> None:
    """Seeded traces stay bit-identical (digests of the traces before drifting_counts and
    drifting_popularity shared one walk; exact=True draws from the walk's generator
    between its drifts)."""
    c = drifting_counts(4, 16, 64, 2, sigma=1.0, steps=5, rho=0.9, seed=seed, exact=exact)
    assert _digest(c) == digest


@pytest.mark.parametrize(("seed", "digest"), [(0, "e44e86cd46489895"), (7, "a533315ce558b4e8")])
def test_drifting_popularity_is_unchanged(seed: int, digest: str) -> None:
    """The popularities to 2^-40: their last bits come from a vectorised ``exp`` (softmax),
    which differs between CPUs (the counts drawn from them are pinned exactly above)."""
    pops = torch.stack(list(drifting_popularity(16, sigma=1.0, steps=5, rho=0.9, seed=seed)))
    assert _digest((pops * 2**40).round().long()) == digest
