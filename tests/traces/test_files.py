"""``moonplan.traces.files``: counts and traces saved and loaded as ``.json`` or ``.npy``.

Legend: T steps, R ranks, E experts.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from moonplan.traces import load_counts, save_counts


@pytest.mark.parametrize("suffix", [".json", ".npy", ".JSON", ".npz"])
@pytest.mark.parametrize("shape", [(3, 5), (4, 2, 3)])
def test_save_load_round_trip(tmp_path, suffix: str, shape: tuple[int, ...]) -> None:
    counts = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    path = tmp_path / f"trace{suffix}"
    save_counts(path, counts)
    loaded = load_counts(str(path))
    assert loaded.dtype == torch.int64 and torch.equal(loaded, counts)


def test_npz_holds_one_array_of_any_integer_type(tmp_path) -> None:
    np.savez_compressed(tmp_path / "small.npz", counts=np.array([[1, 2]], dtype=np.int16))
    assert load_counts(tmp_path / "small.npz").dtype == torch.int64
    np.savez_compressed(tmp_path / "two.npz", a=np.ones((1, 2)), b=np.ones((1, 2)))
    with pytest.raises(ValueError, match="one array"):
        load_counts(tmp_path / "two.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="could not read"):
        load_counts(tmp_path / "bad.npz")


def test_save_accepts_lists_and_numpy(tmp_path) -> None:
    save_counts(tmp_path / "a.json", [[1, 2], [3, 4]])
    save_counts(tmp_path / "b.npy", np.array([[1, 2], [3, 4]], dtype=np.int32))
    assert load_counts(tmp_path / "a.json").tolist() == [[1, 2], [3, 4]]
    assert load_counts(tmp_path / "b.npy").tolist() == [[1, 2], [3, 4]]
    assert json.loads((tmp_path / "a.json").read_text()) == [[1, 2], [3, 4]]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ([1, 2, 3], "shape"),
        ([[[[1]]]], "shape"),
        ([[1.5, 2.0]], "integers"),
        ([[1, -2]], "non-negative"),
        ([[1, 2], [3]], "rectangular"),
        ([[True, False]], "integers"),
        ([], "shape"),
    ],
)
def test_save_and_load_reject_bad_counts(tmp_path, data: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        save_counts(tmp_path / "x.json", data)
    path = tmp_path / "y.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        load_counts(path)


def test_load_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"\.json or \.npy"):
        save_counts(tmp_path / "x.csv", [[1]])
    with pytest.raises(ValueError, match=r"\.json or \.npy"):
        load_counts(tmp_path / "x.pt")
    with pytest.raises(ValueError, match="could not read"):
        load_counts(tmp_path / "missing.npy")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not read"):
        load_counts(tmp_path / "bad.json")
    np.save(tmp_path / "f.npy", np.ones((2, 2)))
    with pytest.raises(ValueError, match="integers"):
        load_counts(tmp_path / "f.npy")
