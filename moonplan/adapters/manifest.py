"""Checkpoint manifests: one id per checkpoint, each shard's size and checksum, verified.

Legend: R ranks that saved, R' ranks that load, C the checkpoint's shard files (C = R).

:func:`~moonplan.adapters.checkpoint.save_sharded` writes each shard, flushes it to disk
and checksums it (read back from the page cache, memory-mapped); rank 0 then writes
``manifest.json`` (under a temporary name, renamed into place: a crash never leaves half
a manifest)::

    {"format": "moonplan-manifest-v1", "checkpoint_id": "<32 hex digits>",
     "world_size": R, "checksum": "crc32",
     "files": {"rank-00000-of-00002.pt": {"bytes": 123, "crc32": "89abcdef"}, ...}}

Every shard's payload carries the same ``checkpoint_id``. :func:`check_file` tells, for
one listed file: missing, truncated (fewer bytes than listed), longer than listed,
corrupt (the checksum differs and the file is of this checkpoint or unreadable), or
from another checkpoint (its payload names another id). Checksum: CRC-32 (``zlib``), which
catches every burst of up to 32 flipped bits and other corruption but for one case in
2**32; it is not meant to resist deliberate tampering. A shard of another checkpoint is
told by its id, not by its checksum. Measured cost: ``docs/wrapping.md``.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

MANIFEST = "manifest.json"
FORMAT = "moonplan-manifest-v1"
CHUNK_BYTES = 64 << 20  # bytes checksummed per call


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: names the file and the problem."""


@dataclass(frozen=True)
class FileRecord:
    """One shard file as the manifest lists it."""

    nbytes: int
    crc32: str  # 8 lowercase hex digits


@dataclass(frozen=True)
class Manifest:
    """A parsed ``manifest.json``."""

    checkpoint_id: str
    world_size: int
    files: dict[str, FileRecord]


def new_checkpoint_id() -> str:
    """A fresh random checkpoint id (32 hex digits)."""
    return secrets.token_hex(16)


def save_file(payload: dict, path: Path) -> FileRecord:
    """``torch.save(payload)`` to ``path``, flushed to disk and checksummed (read back
    from the page cache, which measured cheaper than checksumming through a Python writer
    as ``torch.save`` writes); returns its size and checksum."""
    with open(path, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    nbytes, crc = file_crc32(path)
    return FileRecord(nbytes, crc)


def write_manifest(directory: Path, checkpoint_id: str, files: dict[str, FileRecord]) -> None:
    """Write ``directory/manifest.json`` (by rename: readers see the old or the new one)."""
    body = {
        "format": FORMAT,
        "checkpoint_id": checkpoint_id,
        "world_size": len(files),
        "checksum": "crc32",
        "files": {n: {"bytes": r.nbytes, "crc32": r.crc32} for n, r in sorted(files.items())},
    }
    tmp = directory / f".{MANIFEST}.partial"
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, directory / MANIFEST)


def read_manifest(directory: Path) -> Manifest:
    """The manifest of ``directory``.

    Raises:
        CheckpointError: it is missing (the save did not finish, or an older moonplan
            wrote the checkpoint: load it with ``verify=False``) or unreadable.
    """
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: the save did not finish, or a moonplan without checksums "
            "wrote this checkpoint (load it with verify=False to skip the checks)"
        )
    try:
        body = json.loads(path.read_text())
        files = {n: FileRecord(int(f["bytes"]), str(f["crc32"])) for n, f in body["files"].items()}
        if body["format"] != FORMAT or body["checksum"] != "crc32":
            raise ValueError(f"format {body['format']!r}, checksum {body['checksum']!r}")
        return Manifest(str(body["checkpoint_id"]), int(body["world_size"]), files)
    except KeyError as exc:
        raise CheckpointError(f"{path} is not a {FORMAT} manifest (no {exc})") from None
    except (ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path} is not a {FORMAT} manifest ({exc})") from None


def file_crc32(path: Path) -> tuple[int, str]:
    """``(bytes, crc32)`` of a file (memory-mapped, checksummed in chunks)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0, f"{0:08x}"
        crc = 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for start in range(0, size, CHUNK_BYTES):
                    crc = zlib.crc32(view[start : start + CHUNK_BYTES], crc)
            finally:
                view.release()
    return size, f"{crc:08x}"


def check_file(directory: Path, name: str, listed: FileRecord, checkpoint_id: str) -> str:
    """What is wrong with shard ``name`` against its manifest entry (``""``: nothing)."""
    path = directory / name
    if not path.is_file():
        return f"{path}: missing"
    size = path.stat().st_size
    if size < listed.nbytes:
        return f"{path}: truncated: {size} bytes, the manifest lists {listed.nbytes}"
    if size > listed.nbytes:
        return f"{path}: longer: {size} bytes, the manifest lists {listed.nbytes}"
    _, crc = file_crc32(path)
    if crc == listed.crc32:
        return ""
    other = payload_id(path)
    if other is not None and other != checkpoint_id:
        return f"{path}: from another checkpoint (id {other}; this checkpoint is {checkpoint_id})"
    return f"{path}: corrupt: crc32 {crc}, the manifest lists {listed.crc32}"


def payload_id(path: Path) -> str | None:
    """The ``checkpoint_id`` a shard's payload names (``None``: unreadable or none)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # a corrupt file: any error of the unpickler or the zip reader
        return None
    found = data.get("checkpoint_id") if isinstance(data, dict) else None
    return found if isinstance(found, str) else None
