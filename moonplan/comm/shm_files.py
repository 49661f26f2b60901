"""Names of the ``shm`` heap's files in ``/dev/shm``, and removal of those a dead job left.

Legend: R ranks in the group.

A heap file is named ``moonplan-{token}-r{rank}-p{pid}-s{start}-n{ns}``:

* ``token``: 16 random hex digits of the job (rank 0's, shared through the group);
* ``rank``: the group rank whose memory the file holds;
* ``pid``, ``start``: the creating process's id and its start time (clock ticks since
  boot, field 22 of ``/proc/{pid}/stat``), so a reused pid is not mistaken for the
  creator;
* ``ns``: the inode of the creator's pid namespace (``/proc/self/ns/pid``): a job in
  another container that shares ``/dev/shm`` cannot judge a pid of ours, so it leaves
  our files alone (and we leave its files alone).

The files exist only while a heap is being created (see ``shm_heap``): the memory is
reserved after every rank has unlinked them. A job killed inside that window leaves
empty files; :func:`remove_stale_files` (run by every heap creation, and by
``moonplan doctor``) removes every file whose creator is dead. Files of live
processes, of other users, of other pid namespaces, and names it cannot parse are
never touched.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

SHM_DIR = "/dev/shm"
PREFIX = "moonplan-"
_NAME = re.compile(r"^moonplan-([0-9a-f]+)-r(\d+)-p(\d+)-s(\d+)-n(\d+)$")


@dataclass(frozen=True)
class Owner:
    """The process that creates heap files: pid, start time (ticks), pid-namespace inode."""

    pid: int
    start: int
    ns: int

    def tag(self) -> str:
        """``p{pid}-s{start}-n{ns}``: the owner part of a file name."""
        return f"p{self.pid}-s{self.start}-n{self.ns}"

    @classmethod
    def from_tag(cls, tag: str) -> Owner:
        """Inverse of :meth:`tag`; ``ValueError`` for anything else."""
        m = re.fullmatch(r"p(\d+)-s(\d+)-n(\d+)", tag)
        if m is None:
            raise ValueError(f"not an owner tag: {tag!r}")
        return cls(int(m[1]), int(m[2]), int(m[3]))


@dataclass
class Cleanup:
    """What :func:`remove_stale_files` did: file names removed, and kept with the reason."""

    removed: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)


def this_process() -> Owner:
    """This process as an :class:`Owner` (start time and namespace ``0`` without ``/proc``)."""
    pid = os.getpid()
    return Owner(pid, _start_time(pid) or 0, _pid_namespace())


def shm_path(token: str, rank: int, owner: Owner, directory: str = SHM_DIR) -> str:
    """The file of ``rank``'s heap for job ``token``, created by ``owner``."""
    return os.path.join(directory, f"{PREFIX}{token}-r{rank}-{owner.tag()}")


def parse_name(name: str) -> tuple[str, int, Owner] | None:
    """``(token, rank, owner)`` of a heap file name, or ``None`` if it is not one."""
    m = _NAME.match(name)
    if m is None:
        return None
    return m[1], int(m[2]), Owner(int(m[3]), int(m[4]), int(m[5]))


def is_alive(owner: Owner) -> bool:
    """Whether ``owner`` still runs (same pid *and* same start time)."""
    start = _start_time(owner.pid)
    if start is not None:
        return start == owner.start
    if os.path.isdir("/proc/self"):
        return False  # /proc works, the pid has no entry: the process is gone
    try:  # no /proc: the pid alone decides (a reused pid then counts as alive)
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_files(directory: str = SHM_DIR, *, dry_run: bool = False) -> Cleanup:
    """Remove the heap files in ``directory`` whose creating process is dead.

    Only files of this user, created in this pid namespace, by a process that no longer
    runs, are removed; every other ``moonplan-*`` file is kept with the reason.
    Safe to run concurrently (by every rank of several jobs): a file already removed
    by someone else is skipped. ``dry_run``: report what would be removed, remove nothing.
    """
    out = Cleanup()
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(PREFIX))
    except OSError:
        return out
    ns, uid = _pid_namespace(), os.getuid()
    for name in names:
        why = _keep_reason(os.path.join(directory, name), parse_name(name), ns, uid)
        if why:
            out.kept[name] = why
            continue
        try:
            if not dry_run:
                os.unlink(os.path.join(directory, name))
            out.removed.append(name)
        except FileNotFoundError:
            continue  # another job's cleanup was faster
        except OSError as exc:
            out.kept[name] = f"cannot remove: {exc.strerror}"
    return out


def _keep_reason(path: str, parsed: tuple[str, int, Owner] | None, ns: int, uid: int) -> str:
    """Why ``path`` must stay (``""``: it belongs to a dead process and can go)."""
    if parsed is None:
        return "name without a creator (older moonplan or not a heap file)"
    owner = parsed[2]
    try:
        st = os.stat(path)
    except OSError:
        return "vanished"
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}"
    if owner.ns != ns:
        return "created in another pid namespace"
    if is_alive(owner):
        return f"creator pid {owner.pid} is running"
    return ""


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or ``None`` (no such process or no
    ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # fields from 3 on (the name may hold spaces)
    return int(fields[19])


def _pid_namespace() -> int:
    """Inode of this process's pid namespace (``0`` where ``/proc`` does not show it)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
