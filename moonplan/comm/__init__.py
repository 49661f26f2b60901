"""Communication layer: the EP process group, symmetric heaps, and the all-to-all transport.

* :class:`EPGroup` (``group``): process group + device, collective error agreement.
* :class:`SymmetricHeap` / :class:`SymTensor` (``heap``; backends ``shm_heap``,
  ``nvshmem_heap``, ``ipc_heap`` with its device interface ``ipc_mapper``;
  :func:`create_heap` in ``heap_factory`` picks and opens one): the same allocation on
  every rank with views of the peers' copies.
* ``shm_files``: names of the ``shm`` heap's files (job, rank, creating process) and
  ``remove_stale_files``, which removes those of dead processes (``moonplan doctor``).
* ``a2a.exchange_rows`` / ``a2a.gather_rows``: the ``torch.distributed`` transport
  used where no heap spans the group.
"""

from __future__ import annotations

from moonplan.comm.a2a import exchange_rows, gather_rows
from moonplan.comm.errors import ContractError, HeapUnavailable
from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap, SymTensor
from moonplan.comm.heap_factory import create_heap

__all__ = [
    "ContractError",
    "EPGroup",
    "HeapUnavailable",
    "SymTensor",
    "SymmetricHeap",
    "create_heap",
    "exchange_rows",
    "gather_rows",
]
