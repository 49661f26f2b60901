"""``shm`` symmetric heap: CPU processes on one host sharing files in ``/dev/shm``.

Legend:
    R  ranks in the group       B  heap bytes per rank

Creation (collective, :meth:`ShmHeap.open`):

1. every rank creates ``/dev/shm/moonplan-{token}-r{rank}`` (mode 0600, ``O_EXCL``)
   of ``B`` bytes and reserves its memory with ``posix_fallocate`` (a full
   ``/dev/shm`` fails here, cleanly, rather than with a ``SIGBUS`` on first touch);
   ``token`` is 16 random hex digits chosen by rank 0 and shared through the group;
2. after an agreement that every file exists, every rank maps every rank's file;
3. after an agreement that every mapping succeeded, every rank unlinks the files
   at once (failure paths unlink them too): nothing of the job stays in
   ``/dev/shm``, even if a rank is killed later. The mappings stay valid.

Mappings are ``torch.from_file(path, shared=True, size=B, dtype=torch.uint8)``:
a ``MAP_SHARED`` mapping owned by the tensor's storage, so a view keeps its
memory mapped for as long as it lives (checked with torch 2.13: writes through
one process's mapping are seen through another's). ``torch.frombuffer`` over a
Python ``mmap`` was rejected: the ``mmap`` can be closed while tensor views
still point into it (no buffer export is held), which turns a use-after-close
into a segfault.

Memory starts zeroed (fresh tmpfs pages). A write through ``peer(r)`` is a plain
store into shared memory; :meth:`barrier` (a collective, hence a full memory
barrier on every rank) makes it visible to rank ``r``.
"""

from __future__ import annotations

import contextlib
import os

import torch

from moonplan.comm.errors import ContractError
from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap

SHM_DIR = "/dev/shm"
PREFIX = "moonplan-"


def shm_path(token: str, rank: int) -> str:
    """The file of ``rank``'s heap for job ``token``."""
    return os.path.join(SHM_DIR, f"{PREFIX}{token}-r{rank}")


class ShmHeap(SymmetricHeap):
    """Symmetric heap over ``/dev/shm`` files (see the module docstring).

    Attributes:
        token: the job's random token (the files were ``/dev/shm/moonplan-{token}-r*``).
    """

    backend = "shm"

    def __init__(self, group: EPGroup, nbytes: int, bytes_R: list[torch.Tensor], token: str):
        super().__init__(group, nbytes, bytes_R)
        self.token = token

    @classmethod
    def open(cls, group: EPGroup, nbytes: int, *, token: str) -> ShmHeap:
        """Collective: create, map and unlink the files of job ``token`` (same on every rank).

        Raises:
            ContractError: on every rank, if creating or mapping fails on some rank.
        """
        paths = [shm_path(token, r) for r in range(group.size)]
        err = _create_file(paths[group.rank], nbytes)
        mine = [] if err else [paths[group.rank]]
        try:
            group.agree(not err, err, what="shm heap: create")
        except ContractError:
            _unlink(mine)  # a peer's path may belong to someone else (it failed to create it)
            raise
        except BaseException:
            _unlink(paths)  # a peer died: its file (if any) is this job's
            raise
        try:
            bytes_R, err = _map_files(paths, nbytes)
            group.agree(not err, err, what="shm heap: map peers")
        finally:
            _unlink(paths)  # after the last agreement every rank has mapped every file
        return cls(group, nbytes, bytes_R, token)

    def _release(self, collective: bool) -> None:
        # The files are already unlinked; the memory is unmapped when the last view dies.
        self._bytes_R = []


def _unlink(paths: list[str]) -> None:
    """Unlink every path that still exists (a peer may have unlinked it already)."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _create_file(path: str, nbytes: int) -> str:
    """Create ``path`` (0600, exclusive) with ``nbytes`` reserved; ``""`` or the error."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return f"cannot create {path}: {exc}"
    try:
        os.fchmod(fd, 0o600)
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        return f"cannot reserve {nbytes} bytes for {path}: {exc}"
    finally:
        os.close(fd)
    return ""


def _map_files(paths: list[str], nbytes: int) -> tuple[list[torch.Tensor], str]:
    """``[B]`` uint8 shared mapping of every path, or ``([], error)``."""
    bytes_R = []
    for path in paths:
        try:
            bytes_R.append(torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8))
        except (RuntimeError, OSError) as exc:
            return [], f"cannot map {path}: {exc}"
    return bytes_R, ""
