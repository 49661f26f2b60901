"""host_int64, host_bool and host_numpy: tensors or arrays on the host, no needless copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moonplan.host_arrays import host_bool, host_int64, host_numpy


def test_host_int64_keeps_the_contract() -> None:
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert host_int64(a) is a  # no copy of an int64 array
    t = torch.arange(6).reshape(2, 3)
    assert np.shares_memory(host_int64(t), t.numpy())  # a view of a CPU tensor
    assert host_int64(torch.arange(3, dtype=torch.int32)).dtype == np.int64
    assert host_int64([[1, 2]]).tolist() == [[1, 2]]
    assert host_int64(torch.ones(2, requires_grad=True).long()).tolist() == [1, 1]
    assert host_int64(torch.ones(2, requires_grad=True)).tolist() == [1, 1]  # detached


def test_host_bool_keeps_the_contract() -> None:
    assert host_bool(torch.tensor([0, 2, 0])).tolist() == [False, True, False]
    assert host_bool(np.array([True, False])).dtype == np.bool_
    assert host_bool([[0, 1]]).tolist() == [[False, True]]
    t = torch.tensor([True, False])
    assert np.shares_memory(host_bool(t), t.numpy())


def test_host_numpy_converts_tensors_only() -> None:
    class NotATensor:
        """Has a ``detach`` but is no tensor: passed on as it is, never probed."""

        def detach(self) -> None:
            raise AssertionError("probed")

    odd = NotATensor()
    assert host_numpy(odd) is odd
    assert host_numpy([1, 2]) == [1, 2]
    assert isinstance(host_numpy(torch.zeros(2)), np.ndarray)


@pytest.mark.gpu
def test_a_device_tensor_is_copied_to_the_host() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    t = torch.arange(4, device="cuda", dtype=torch.int32)
    assert host_int64(t).tolist() == [0, 1, 2, 3]
    assert host_bool(t).tolist() == [False, True, True, True]
