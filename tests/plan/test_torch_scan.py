"""The torch scans read nothing on the host where they run masked (accelerators).

Legend: R ranks, E experts, M experts per home group.

``moonplan.plan.torch_scan`` promises CUDA-graph-capturable scans on accelerators: no
value read on the host. "meta" tensors have no values, so any host read (``.item()``,
``bool(t)``, indexing with a 0-d tensor) raises there: running the scans on "meta"
checks the promise without a GPU. Their results equal the reference on CPU tensors
(``tests/plan/test_backends.py``, ``scan="tensor"``).
"""

from __future__ import annotations

import torch

from moonplan.plan.torch_scan import balance_groups_torch, split_groups_torch


def test_the_scans_run_on_meta_tensors_with_previous_flows_and_residents() -> None:
    R, E, M = 4, 8, 2
    meta = torch.device("meta")
    load_R = torch.empty(R, dtype=torch.int64, device=meta)
    warm_RR = torch.empty(R, R, dtype=torch.bool, device=meta)
    prev_F3 = torch.empty(R - 1, 3, dtype=torch.int64, device=meta)
    quota_RR, flow_F3 = balance_groups_torch(load_R, load_R - 1, warm_RR, prev_F3)
    assert quota_RR.shape == (R, R) and flow_F3.shape == (R - 1, 3)
    assert quota_RR.device == flow_F3.device == meta
    ids_RM = torch.empty(R, M, dtype=torch.int64, device=meta)
    rem_RM = torch.empty(R, M, dtype=torch.int64, device=meta)
    resident_ER = torch.empty(E, R, dtype=torch.bool, device=meta)
    alloc_ER = torch.empty(E, R, dtype=torch.int64, device=meta)
    split_groups_torch(quota_RR, ids_RM, rem_RM, resident_ER, alloc_ER)
    assert alloc_ER.shape == (E, R) and alloc_ER.device == meta
