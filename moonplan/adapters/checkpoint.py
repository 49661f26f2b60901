"""Checkpoints of wrapped models: per-rank files, the original layout, any number of ranks.

Legend:
    R ranks that saved, R' ranks that load, E experts of a layer,
    [lo, hi) a rank's home labels (its rows of every expert tensor: the model experts
    ``order[lo:hi]`` under a home order, ``lo .. hi-1`` without one)

The files of :func:`save_sharded` hold a wrapped model's state under the original keys:
expert tensors (``...experts.gate_up_proj``, ``...experts.down_proj``; for torchtitan's
MoE ``...routed_experts.inner_experts.w1_EFD``, ``w2_EDF``, ``w3_EFD``) hold only the
rank's home rows of the full ``[E, ...]`` tensor (rows by model id), every other entry
is replicated. A layer with a ``home_order`` (:mod:`moonplan.core.sharded`) saves its
order beside its rows, and every reader takes rows by model id, so a checkpoint loads
under any other home order and EP size. (``model.state_dict()`` itself shows one key per
expert by default: :func:`per_expert_keys`.)

* :func:`save_sharded` (every rank): ``directory/rank-{r:05d}-of-{R:05d}.pt``; rank 0's
  file has the replicated entries too, the others only their expert rows; then
  ``manifest.json``: the checkpoint's id and each file's size and checksum
  (:mod:`moonplan.adapters.manifest`).
* :func:`consolidate` (one process, no process group): the original, unwrapped
  layout, e.g. for ``unwrapped.load_state_dict`` or ``save_pretrained``.
* :func:`load_sharded` (every rank, any ``R'``): each rank reads only the rows it owns
  under ``R'`` (files are memory-mapped).
* :func:`load_full` (every rank): from a state dict in the original layout.
* :func:`gather_full_state_dict` (collective, in memory): the original layout on every rank.
* :func:`per_expert_keys`: how ``state_dict()`` shows the experts: one key per expert
  (the default, for ``torch.distributed.checkpoint`` (DCP) and torchtitan's checkpointer
  at any EP size) or the home rows under the original keys.

``consolidate`` and ``load_sharded`` verify the files against the manifest first
(``verify=True``, the default): a missing, truncated, corrupt file or one of another
checkpoint raises :class:`~moonplan.adapters.manifest.CheckpointError` naming the file
and the problem; ``load_sharded`` spreads the checksums over the loading ranks (each
file read once in all) and raises the same error on every rank.

File payload: ``{"format": FORMAT, "checkpoint_id": id, "rank": r, "world_size": R,
"experts": {key: (E, lo, hi)}, "state": {key: tensor}}`` (CPU tensors, ``torch.save``;
read with ``weights_only=True``). Where a layer has a home order the format is
``FORMAT_ORDERED`` and the payload also holds ``"home_order": {key: [E model ids]}``
(rows ``[lo, hi)`` of ``key`` are model experts ``order[lo:hi]``), so that a reader that
does not know orders refuses the file rather than misplacing rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moonplan.adapters.manifest import (
    MANIFEST,
    CheckpointError,
    FileRecord,
    check_file,
    new_checkpoint_id,
    read_manifest,
    save_file,
    write_manifest,
)
from moonplan.adapters.model import sharded_experts
from moonplan.core.sharded import home_ids, home_rows
from moonplan.plan.home import home_start, max_local

FORMAT = "moonplan-sharded-v1"
FORMAT_ORDERED = "moonplan-sharded-v2"  # v1 and the layers' home orders
FORMATS = (FORMAT, FORMAT_ORDERED)
_PROBLEM_BYTES = 4096  # most bytes of one rank's verification problems (JSON)
_FILE = re.compile(r"rank-(\d{5})-of-(\d{5})\.pt")
Layout = dict[str, tuple[int, int, int]]  # key -> (E, lo, hi)
Orders = dict[str, tuple[int, ...]]  # key -> its layer's home order (layers with one)


def expert_layout(model: nn.Module) -> Layout:
    """``{state-dict key: (E, lo, hi)}`` of every sharded expert tensor of ``model``
    (``(lo, hi)``: this rank's home labels)."""
    layout: Layout = {}
    for name, ex in sharded_experts(model):
        prefix = f"{name}." if name else ""
        for t in ex.expert_tensors:
            layout[prefix + t] = (ex.num_experts, *ex.home_range)
    return layout


def expert_orders(model: nn.Module) -> Orders:
    """``{state-dict key: home order}`` of every sharded expert tensor of ``model`` whose
    layer has a ``home_order`` (layers without one are left out: labels are model ids)."""
    orders: Orders = {}
    for name, ex in sharded_experts(model):
        prefix = f"{name}." if name else ""
        if ex.home_order is not None:
            orders.update({prefix + t: tuple(ex.home_order) for t in ex.expert_tensors})
    return orders


def _group_of(model: nn.Module) -> Any:
    for _, ex in sharded_experts(model):
        return ex
    raise ValueError(f"{type(model).__name__} has no wrapped experts (use moonplan.wrap_model)")


def file_name(rank: int, world_size: int) -> str:
    """``rank-{rank:05d}-of-{world_size:05d}.pt``."""
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def save_sharded(model: nn.Module, directory: str | Path) -> Path:
    """Write this rank's part of ``model``'s state and the manifest (collective: every
    rank calls it). Returns this rank's file.

    Each rank's file is written, flushed to disk and checksummed; rank 0 then writes the
    manifest (under a temporary name, renamed into place) and removes files of another
    world size. A save that did not finish leaves the previous manifest (or none),
    against which the new files fail verification: never a checkpoint that loads mixed.

    Raises:
        ContractError: on every rank, naming the ranks where writing failed (or their
            own error, where every rank failed alike).
    """
    ex = _group_of(model)
    group, r, R = ex.group, ex.group.rank, ex.group.size
    out = Path(directory)
    checkpoint_id = group.all_gather_bytes(new_checkpoint_id().encode(), 64)[0].decode()
    err: Exception | None = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        layout, orders = expert_layout(model), expert_orders(model)
        with _home_keys(model):
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        state = {k: v for k, v in state.items() if k in layout or r == 0}
        payload = {"format": FORMAT_ORDERED if orders else FORMAT, "checkpoint_id": checkpoint_id,
                   "rank": r, "world_size": R, "experts": layout, "state": state}  # fmt: skip
        if orders:
            payload["home_order"] = {k: list(v) for k, v in orders.items()}
        record = save_file(payload, out / file_name(r, R))
        mine = json.dumps([record.nbytes, record.crc32]).encode()
    except Exception as exc:
        err, mine = exc, b'[0, ""]'
    group.outcome(f"save_sharded({out})", err)
    rows = [json.loads(row) for row in group.all_gather_bytes(mine, 64)]
    if r == 0:
        try:
            files = {file_name(q, R): FileRecord(n, c) for q, (n, c) in enumerate(rows)}
            write_manifest(out, checkpoint_id, files)
            for stale, (_, world) in _scan(out).items():
                if world != R:
                    stale.unlink()
        except Exception as exc:
            err = exc
    group.outcome(f"save_sharded({out}): rank 0 writing the manifest", err)
    return out / file_name(r, R)


def _scan(directory: Path) -> dict[Path, tuple[int, int]]:
    found: dict[Path, tuple[int, int]] = {}
    for p in directory.iterdir():
        m = _FILE.fullmatch(p.name)
        if m:
            found[p] = (int(m.group(1)), int(m.group(2)))
    return found


def _read_all(directory: str | Path, checkpoint_id: str | None = None) -> list[dict]:
    """Every rank's payload (memory-mapped), by rank; ``CheckpointError`` naming the file if
    the set is incomplete, a file cannot be read, or (``checkpoint_id`` given) a payload
    names another checkpoint."""
    d = Path(directory)
    found = _scan(d) if d.is_dir() else {}
    worlds = {w for _, w in found.values()}
    if len(worlds) != 1:
        what = f"world sizes {sorted(worlds)}" if worlds else "no rank-*-of-*.pt files"
        raise CheckpointError(f"{d} does not hold one sharded checkpoint: found {what}")
    (R,) = worlds
    by_rank = {r: p for p, (r, _) in found.items()}
    missing = sorted(set(range(R)) - set(by_rank))
    if missing:
        raise CheckpointError(f"{d}: checkpoint of {R} ranks lacks the files of ranks {missing}")
    payloads = []
    for r in range(R):
        try:
            data = torch.load(by_rank[r], map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # a truncated or foreign file: name it
            why = f"{type(exc).__name__}: {exc}"
            raise CheckpointError(f"{by_rank[r]}: cannot be read ({why})") from exc
        if not isinstance(data, dict) or data.get("format") not in FORMATS or data.get("rank") != r:
            raise CheckpointError(f"{by_rank[r]} is not a {FORMAT} file of rank {r}")
        if checkpoint_id is not None and data.get("checkpoint_id") != checkpoint_id:
            raise CheckpointError(
                f"{by_rank[r]}: from another checkpoint (id {data.get('checkpoint_id')}; "
                f"the manifest's is {checkpoint_id})"
            )
        payloads.append(data)
    return payloads


def verify_files(directory: str | Path) -> str:
    """Check every file of a checkpoint against its manifest; returns the checkpoint id.

    Raises:
        CheckpointError: the manifest is missing or unreadable, or files are missing,
            truncated, corrupt or of another checkpoint (each named, with the problem).
    """
    checkpoint_id, problems = file_problems(directory)
    if problems:
        raise CheckpointError("; ".join(problems))
    assert checkpoint_id is not None
    return checkpoint_id


def file_problems(
    directory: str | Path, rank: int = 0, ranks: int = 1
) -> tuple[str | None, list[str]]:
    """``(checkpoint id, problems)`` of a checkpoint against its manifest (``None``, and the
    problem, where the manifest cannot be read). ``rank`` of ``ranks`` checksums every
    ``ranks``-th file from its own (each file read once over all ``ranks``)."""
    d = Path(directory)
    if not (d.is_dir() and _scan(d)):
        return None, [f"{d} does not hold a sharded checkpoint: no rank-*-of-*.pt files"]
    try:
        manifest = read_manifest(d)
    except CheckpointError as exc:
        return None, [str(exc)]
    want = {file_name(r, manifest.world_size) for r in range(manifest.world_size)}
    if set(manifest.files) != want:
        return None, [f"{d / MANIFEST} lists {sorted(manifest.files)}, not {sorted(want)}"]
    names = sorted(manifest.files)[rank::ranks]
    problems = [check_file(d, n, manifest.files[n], manifest.checkpoint_id) for n in names]
    return manifest.checkpoint_id, [p for p in problems if p]


def _verified(group: Any, directory: str | Path) -> str:
    """Collective: the checkpoint id, each file checked by one rank; else the same
    ``CheckpointError`` on every rank listing every problem found (by any rank)."""
    try:
        checkpoint_id, problems = file_problems(directory, group.rank, group.size)
    except Exception as exc:  # e.g. a permission error: this rank's, named
        checkpoint_id, problems = None, [f"rank {group.rank}: {type(exc).__name__}: {exc}"]
    mine = json.dumps(problems).encode()
    while len(mine) > _PROBLEM_BYTES:  # keep what fits, deterministically
        problems = problems[:-1]
        mine = json.dumps([*problems, "(more problems not shown)"]).encode()
    found = {p for row in group.all_gather_bytes(mine, _PROBLEM_BYTES) for p in json.loads(row)}
    if found:
        raise CheckpointError("; ".join(sorted(found)))
    assert checkpoint_id is not None
    return checkpoint_id


def _held(data: dict, key: str) -> list[int]:
    """Model ids of the rows of ``key`` in one saved payload, in their order."""
    _, lo, hi = data["experts"][key]
    return home_ids((lo, hi), data.get("home_order", {}).get(key))


def _rows(payloads: list[dict], key: str, ids: list[int]) -> torch.Tensor:
    """Rows of model experts ``ids`` of the full expert tensor ``key`` (``[len(ids), ...]``,
    in that order), assembled from the saved shards: a slice per run of consecutive saved
    rows, so the linear layout reads each shard's rows as one slice."""
    E = payloads[0]["experts"][key][0]
    where: dict[int, tuple[int, int]] = {}  # model id -> (payload, row)
    for p, data in enumerate(payloads):
        if data["experts"][key][0] != E:
            raise ValueError(f"{key}: rank {data['rank']} saved E={data['experts'][key][0]}, "
                             f"rank 0 saved E={E}")  # fmt: skip
        where.update({e: (p, row) for row, e in enumerate(_held(data, key))})
    absent = [e for e in ids if e not in where]
    if absent:
        raise ValueError(f"{key}: the saved shards do not hold experts {absent[:8]}")
    runs: list[list[int]] = []  # [payload, first row, rows] of consecutive saved rows
    for e in ids:
        p, row = where[e]
        if runs and runs[-1][0] == p and runs[-1][1] + runs[-1][2] == row:
            runs[-1][2] += 1
        else:
            runs.append([p, row, 1])
    pieces = [payloads[p]["state"][key][a : a + n] for p, a, n in runs]
    return torch.cat(pieces, 0) if pieces else payloads[0]["state"][key][:0]


def consolidate(directory: str | Path, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """The original (unwrapped) state dict from a directory written by :func:`save_sharded`.

    Expert tensors become ``[E, ...]``; keys keep rank 0's order. Needs no process group.
    ``verify``: check every file against the manifest first (:func:`verify_files`).

    Raises:
        CheckpointError: naming each file that is missing, truncated, corrupt or of
            another checkpoint.
    """
    checkpoint_id = verify_files(directory) if verify else None
    payloads = _read_all(directory, checkpoint_id)
    layout: Layout = payloads[0]["experts"]
    full = {}
    for key, value in payloads[0]["state"].items():
        everyone = list(range(layout[key][0])) if key in layout else []
        full[key] = _rows(payloads, key, everyone) if key in layout else value.clone()
    return full


def load_sharded(model: nn.Module, directory: str | Path, *, verify: bool = True) -> None:
    """Load a sharded checkpoint into a wrapped ``model`` on any number of ranks.

    Every rank calls it; each reads the replicated entries and only its own expert rows.
    ``verify``: first check the files against the manifest, the checksums spread over
    the ranks (each file read once in all; cost: ``docs/wrapping.md``).

    Raises:
        CheckpointError: on every rank, the same: naming each file that is missing,
            truncated, corrupt or of another checkpoint; expert counts that differ from
            the model's.
        ContractError: on every rank, where the ranks failed differently (each named).
        RuntimeError: keys or shapes that do not match (``load_state_dict(strict=True)``).
    """
    group = _group_of(model).group
    checkpoint_id = _verified(group, directory) if verify else None
    err: Exception | None = None
    try:
        _load_payloads(model, _read_all(directory, checkpoint_id))
    except Exception as exc:
        err = exc
    group.outcome(f"load_sharded({directory})", err)


def _load_payloads(model: nn.Module, payloads: list[dict]) -> None:
    """Load this rank's part of the saved ``payloads`` into ``model``."""
    saved: Layout = payloads[0]["experts"]
    state: dict[str, torch.Tensor] = {}
    for key, value in payloads[0]["state"].items():
        if key not in saved:
            state[key] = value
    orders = expert_orders(model)
    for key, (E, lo, hi) in expert_layout(model).items():
        if key not in saved or saved[key][0] != E:
            got = saved[key][0] if key in saved else "nothing"
            raise CheckpointError(f"{key}: the model has {E} experts, the checkpoint {got}")
        state[key] = _rows(payloads, key, home_ids((lo, hi), orders.get(key)))
    _load(model, state)


def load_full(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a state dict in the original layout (expert tensors ``[E, ...]``) into a
    wrapped ``model``: every rank keeps its home rows (by model id, whatever its home
    order). Every rank calls it."""
    state = dict(state_dict)
    orders = expert_orders(model)
    for key, (E, lo, hi) in expert_layout(model).items():
        full = state.get(key)
        if full is None or full.shape[0] != E:
            got = tuple(full.shape) if full is not None else "nothing"
            raise ValueError(f"{key}: expected the full [{E}, ...] tensor, got {got}")
        state[key] = home_rows(full, lo, hi, orders.get(key))
    _load(model, state)


def _load(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    model.load_state_dict(state, strict=True)
    for _, ex in sharded_experts(model):
        ex.weights_changed()


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The original layout, on every rank (collective: every rank calls it).

    Expert tensors are all-gathered over each layer's group (padded to ``ceil(E/R)`` rows)
    and put in model-id order; the result lives on the group's device.
    """
    experts = dict(sharded_experts(model))
    with _home_keys(model):
        state = dict(model.state_dict())
    for name, ex in experts.items():
        prefix = f"{name}." if name else ""
        for t in ex.expert_tensors:
            state[prefix + t] = _all_gather_rows(ex, state[prefix + t])
    return state


def _all_gather_rows(ex: Any, home: torch.Tensor) -> torch.Tensor:
    """``[E, ...]`` by model id from every rank's ``[E_r, ...]`` home rows (the linear
    home map of labels, then the layer's home order undone)."""
    R, E = ex.group.size, ex.num_experts
    M = max_local(E, R)
    pad = home.new_zeros((M, *home.shape[1:]))
    pad[: home.shape[0]] = home.detach()
    got = ex.group.all_gather(pad)  # [R, M, ...]
    sizes = [home_start(r + 1, E, R) - home_start(r, E, R) for r in range(R)]
    full = torch.cat([got[r, : sizes[r]] for r in range(R)], 0)  # by label
    if ex.home_order is None:
        return full
    return full.index_select(0, ex.runtime.label_E)  # row e: model expert e


def per_expert_keys(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Choose how ``model.state_dict()`` shows every wrapped layer's experts; returns
    ``model``.

    ``True`` (the default of every wrapped layer): each home expert under its own key,
    ``<expert tensor>.<e>`` (``e`` the model expert id, a view of its rows). Every key
    then names one tensor of one size whatever the EP size and home order, which is what
    ``torch.distributed.checkpoint`` needs (it stores a plain tensor once per key, as if
    replicated): ``dcp.save(model.state_dict(), checkpoint_id=d)`` writes each expert
    from its home rank, and at any EP size ``sd = model.state_dict(); dcp.load(sd,
    checkpoint_id=d); model.load_state_dict(sd)`` reads the experts each rank owns;
    torchtitan's checkpointer does the same. ``False``: the rank's home rows under the
    tensor's own name (the original keys, ``[E_r, ...]``): never give that to DCP, which
    would keep one rank's rows for every rank. ``load_state_dict`` takes both layouts in
    either mode; moonplan's own calls (:func:`save_sharded`,
    :func:`gather_full_state_dict`) do not depend on it.
    """
    for _, ex in sharded_experts(model):
        ex.per_expert_keys = enabled
    return model


@contextmanager
def _home_keys(model: nn.Module) -> Iterator[None]:
    """``model.state_dict()`` with the home-rows layout inside, whatever the mode."""
    experts = [ex for _, ex in sharded_experts(model)]
    modes = [ex.per_expert_keys for ex in experts]
    for ex in experts:
        ex.per_expert_keys = False
    try:
        yield
    finally:
        for ex, mode in zip(experts, modes, strict=True):
            ex.per_expert_keys = mode
