"""``shm`` symmetric heap: CPU processes on one host sharing files in ``/dev/shm``.

Legend:
    R  ranks in the group       Y  heap bytes per rank

Creation (collective, :meth:`ShmHeap.open`) keeps the files visible in ``/dev/shm``
for as short a time as it can, and reserves no memory while they are:

1. every rank removes the files of dead jobs (``shm_files.remove_stale_files``),
   then creates its empty file ``/dev/shm/moonplan-{token}-r{rank}-p{pid}-s{start}-n{ns}``
   (mode 0600, ``O_EXCL``; the name says who created it, see ``shm_files``);
   ``token`` is 16 random hex digits chosen by rank 0, the creator parts come from
   every rank's survey entry;
2. after an agreement that every file exists, every rank opens every rank's file;
3. after an agreement that every open succeeded, every rank unlinks every file
   (failure paths unlink them too). From here on nothing of the job is in
   ``/dev/shm``: the open descriptors keep the memory alive;
4. every rank reserves ``Y`` bytes in its own file with ``posix_fallocate`` (a full
   ``/dev/shm`` or a file-size limit fails here, cleanly, rather than with a
   ``SIGBUS`` on first touch), and after an agreement that every reservation
   succeeded, maps every rank's file through ``/proc/self/fd/{fd}`` and closes the
   descriptors; a last agreement checks every mapping.

A rank killed during steps 1-3 leaves at most empty files, named after a dead
process: the next heap creation on the host, or ``moonplan doctor``, removes them.
A rank killed later leaves nothing: its memory goes with the last mapping.

Mappings are ``torch.from_file(path, shared=True, size=Y, dtype=torch.uint8)``:
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
from collections.abc import Sequence

import torch

from moonplan.comm.errors import ContractError
from moonplan.comm.group import EPGroup
from moonplan.comm.heap import SymmetricHeap
from moonplan.comm.shm_files import PREFIX, SHM_DIR, Owner, remove_stale_files, shm_path

__all__ = ["PREFIX", "SHM_DIR", "ShmHeap", "shm_path"]


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
    def open(cls, group: EPGroup, nbytes: int, *, token: str, owners: Sequence[Owner]) -> ShmHeap:
        """Collective: create, open, unlink, reserve and map the files of job ``token``.

        Args:
            token: the job's token (same on every rank).
            owners: ``[R]`` every rank's process (same list on every rank).

        Raises:
            ContractError: on every rank, if a step fails on some rank; nothing stays
                in ``/dev/shm`` and no memory stays reserved.
        """
        remove_stale_files()
        paths = [shm_path(token, r, owners[r]) for r in range(group.size)]
        fds: list[int] = []
        try:
            _create_and_open(group, paths, fds)
            err = _reserve(fds[group.rank], nbytes)
            group.agree(not err, err, what="shm heap: reserve memory")
            bytes_R, err = _map_fds(fds, nbytes)
            _close(fds)
            group.agree(not err, err, what="shm heap: map peers")
        finally:
            _close(fds)
        return cls(group, nbytes, bytes_R, token)

    def _release(self, collective: bool) -> None:
        # The files are already unlinked; the memory is unmapped when the last view dies.
        self._bytes_R = []


def _create_and_open(group: EPGroup, paths: list[str], fds: list[int]) -> None:
    """Steps 1-3: create this rank's file, open every rank's, unlink them all; ``fds``
    receives the ``[R]`` descriptors (empty on failure)."""
    fd, err = _create_file(paths[group.rank])
    try:
        group.agree(not err, err, what="shm heap: create")
    except ContractError:
        _close([fd])
        _unlink([paths[group.rank]] if fd >= 0 else [])  # a peer's path may be someone else's
        raise
    except BaseException:
        _close([fd])
        _unlink(paths)  # a peer died: its file (if any) is this job's
        raise
    try:
        fds += _open_peers(paths, group.rank, fd)
        fd = -1  # now in fds
        err = "" if len(fds) == len(paths) else f"cannot open {paths[len(fds)]}"
        group.agree(not err, err, what="shm heap: open peers")
    finally:
        _close([fd])
        _unlink(paths)  # after that agreement every rank holds every file open


def _open_peers(paths: list[str], rank: int, own_fd: int) -> list[int]:
    """Descriptors of every path (``own_fd`` for ``rank``'s); stops at the first failure."""
    fds = []
    for r, path in enumerate(paths):
        if r == rank:
            fds.append(own_fd)
            continue
        try:
            fds.append(os.open(path, os.O_RDWR | os.O_CLOEXEC))
        except OSError:
            break
    if len(fds) < len(paths) and own_fd not in fds:
        _close([own_fd])
    return fds


def _create_file(path: str) -> tuple[int, str]:
    """Create ``path`` empty (0600, exclusive): ``(fd, "")`` or ``(-1, error)``."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return -1, f"cannot create {path}: {exc}"
    try:
        os.fchmod(fd, 0o600)
    except OSError as exc:
        _close([fd])
        _unlink([path])
        return -1, f"cannot set the mode of {path}: {exc}"
    return fd, ""


def _reserve(fd: int, nbytes: int) -> str:
    """Reserve ``nbytes`` of tmpfs memory for the (unlinked) file ``fd``; ``""`` or the error."""
    if not nbytes:
        return ""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        return f"cannot reserve {nbytes} bytes in {SHM_DIR}: {exc}"
    return ""


def _map_fds(fds: list[int], nbytes: int) -> tuple[list[torch.Tensor], str]:
    """``[Y]`` uint8 shared mapping of every descriptor, or ``([], error)``."""
    bytes_R = []
    for r, fd in enumerate(fds):
        try:
            path = f"/proc/self/fd/{fd}"
            bytes_R.append(torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8))
        except (RuntimeError, OSError) as exc:
            return [], f"cannot map rank {r}'s file: {exc}"
    return bytes_R, ""


def _close(fds: list[int]) -> None:
    """Close every descriptor ``>= 0`` (once: the list is emptied)."""
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
    fds.clear()


def _unlink(paths: list[str]) -> None:
    """Unlink every path that still exists (a peer may have unlinked it already)."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
