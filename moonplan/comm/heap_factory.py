"""``create_heap``: the collective that picks a symmetric-heap backend and opens it.

Legend:
    R  ranks in the group       Y  heap bytes per rank (``nbytes``)

Backends (identical ``backend`` on every rank; ``None`` reads ``MOONPLAN_HEAP``, default
``"auto"``, which is how a layer's heap is picked):

* ``"shm"``: CPU processes on one host, files in ``/dev/shm`` (:mod:`moonplan.comm.shm_heap`);
* ``"nvshmem"``: CUDA devices through nvshmem4py (:mod:`moonplan.comm.nvshmem_heap`);
* ``"ipc"``: CUDA processes on one host mapping each other's memory, several per GPU
  or one per GPU of a P2P domain (:mod:`moonplan.comm.ipc_heap`);
* ``"auto"``: on CUDA, nvshmem when nvshmem4py is usable on every rank and every rank
  has a device of its own (NVSHMEM's one PE per GPU), else ipc when every rank runs on
  the same host; on the CPU, shm when every rank runs on the same host; otherwise
  :class:`HeapUnavailable` (with the reason) on every rank, so that the caller can
  switch to the all-to-all transport (``moonplan.comm.a2a``) explicitly.

It lives apart from the base class :class:`~moonplan.comm.heap.SymmetricHeap` so
that the implementations import the base and this module imports them, with no
import cycle (docs/design.md §5).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from typing import Any

from moonplan.comm.errors import ContractError, HeapUnavailable
from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap
from moonplan.comm.ipc_heap import IpcHeap, get_mapper
from moonplan.comm.nvshmem_heap import NvshmemHeap
from moonplan.comm.nvshmem_heap import available as nvshmem_available
from moonplan.comm.shm_files import SHM_DIR, Owner, this_process
from moonplan.comm.shm_heap import ShmHeap

__all__ = ["BACKENDS", "create_heap"]

BACKENDS = ("auto", "shm", "nvshmem", "ipc")
ENV = "MOONPLAN_HEAP"  # the backend of create_heap(backend=None): a layer's heap
_SURVEY_BYTES = 2048


def create_heap(group: EPGroup, nbytes: int, *, backend: str | None = None) -> SymmetricHeap:
    """Collective: build a heap of ``nbytes`` per rank over ``group``.

    Args:
        group: the ranks that share the heap.
        nbytes: bytes per rank (``>= 0``), identical on every rank.
        backend: ``"auto"``, ``"shm"``, ``"nvshmem"`` or ``"ipc"`` (identical on every
            rank); ``None`` (what a layer passes): ``$MOONPLAN_HEAP``, default ``"auto"``.

    Raises:
        HeapUnavailable: on every rank, when the backend cannot span the group.
        ContractError: on every rank, when ``nbytes``/``backend`` differ across ranks
            or creating the heap fails on some rank.
    """
    if backend is None:
        backend = os.environ.get(ENV, "auto")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r} (${ENV})")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    survey = _survey(group, backend, nbytes)
    chosen = _choose_backend(group, backend, survey)
    if chosen == "shm":
        owners = [Owner.from_tag(s["owner"]) for s in survey]
        return ShmHeap.open(group, nbytes, token=survey[0]["token"], owners=owners)
    if chosen == "ipc":
        return IpcHeap.open(group, nbytes, [s["device_id"] for s in survey])
    return NvshmemHeap.open(group, nbytes)


# ---- backend choice (one collective: every rank decides from the same survey) -------
def _survey(group: EPGroup, backend: str, nbytes: int) -> list[dict[str, Any]]:
    """Every rank's request and capabilities (one all-gather); checks the request agrees."""
    cuda = group.device.type == "cuda"
    nv_ok, nv_why = nvshmem_available() if cuda or backend == "nvshmem" else (False, "")
    device_id, ipc_why = "", ""
    if cuda or backend == "ipc":
        device_id, ipc_why = get_mapper().identity(group.device)
    mine = {
        "backend": backend,
        "nbytes": nbytes,
        "host": socket.gethostname(),
        "cuda": cuda,
        "shm": _shm_usable(),
        "owner": this_process().tag(),
        "nvshmem": nv_ok,
        "why": nv_why[:300],
        "device_id": device_id[:80],
        "ipc_why": ipc_why[:300],
        "token": secrets.token_hex(8),
    }
    rows = group.all_gather_bytes(json.dumps(mine).encode(), _SURVEY_BYTES)
    survey = [json.loads(row) for row in rows]
    for key in ("backend", "nbytes"):
        values = [s[key] for s in survey]
        if len(set(values)) > 1:
            bad = tuple(r for r, v in enumerate(values) if v != values[0])
            raise ContractError(f"create_heap: {key} differs across ranks: {values}", bad)
    return survey


def _shm_usable() -> bool:
    """``/dev/shm`` is a writable directory and ``/proc/self/fd`` reopens descriptors."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) and os.path.isdir("/proc/self/fd")


def _choose_backend(group: EPGroup, backend: str, survey: list[dict[str, Any]]) -> str:
    if backend == "auto":
        backend = _auto_backend(survey)
    if backend == "nvshmem":
        bad = [(r, s["why"]) for r, s in enumerate(survey) if not s["nvshmem"]]
        if bad:
            reasons = "; ".join(f"rank {r}: {why}" for r, why in bad)
            raise HeapUnavailable(f"nvshmem heap unavailable ({reasons}); use the a2a transport")
        return backend
    _one_host(backend, survey)
    if backend == "ipc":
        bad = [(r, s["ipc_why"]) for r, s in enumerate(survey) if s["ipc_why"]]
        if bad:
            reasons = "; ".join(f"rank {r}: {why}" for r, why in bad)
            raise HeapUnavailable(f"ipc heap unavailable ({reasons}); use the a2a transport")
        return backend
    no_shm = [r for r, s in enumerate(survey) if not s["shm"]]
    if no_shm:
        raise HeapUnavailable(
            f"shm heap: /dev/shm is not a writable directory (or /proc/self/fd is missing) "
            f"on rank {no_shm}; use the a2a transport"
        )
    return backend


def _auto_backend(survey: list[dict[str, Any]]) -> str:
    """CPU: shm. CUDA: nvshmem where every rank can use it on a device of its own (one PE
    per GPU), else ipc (ranks sharing a GPU, or no nvshmem4py)."""
    if not any(s["cuda"] for s in survey):
        return "shm"
    ids = [s["device_id"] for s in survey]
    own_devices = all(ids) and len(set(ids)) == len(ids)
    return "nvshmem" if own_devices and all(s["nvshmem"] for s in survey) else "ipc"


def _one_host(backend: str, survey: list[dict[str, Any]]) -> None:
    """Raise :class:`HeapUnavailable` unless every rank runs on one host."""
    hosts: dict[str, list[int]] = {}
    for r, s in enumerate(survey):
        hosts.setdefault(s["host"], []).append(r)
    if len(hosts) > 1:
        raise HeapUnavailable(
            f"{backend} heap needs every rank on one host; the group spans {len(hosts)} hosts "
            f"{hosts}; use the a2a transport"
        )
