"""Checkpoints of wrapped models: per-rank files, the original layout, any number of ranks.

Legend:
    R ranks that saved, R' ranks that load, E experts of a layer,
    [lo, hi) a rank's home experts (its rows of every expert tensor)

A wrapped model's ``state_dict`` has the original keys; expert tensors
(``...experts.gate_up_proj``, ``...experts.down_proj``; for torchtitan's MoE
``...routed_experts.inner_experts.w1_EFD``, ``w2_EDF``, ``w3_EFD``) hold only the rank's
home rows ``[lo, hi)`` of the full ``[E, ...]`` tensor, every other entry is replicated.

* :func:`save_sharded` (every rank): ``directory/rank-{r:05d}-of-{R:05d}.pt``; rank 0's
  file has the replicated entries too, the others only their expert rows.
* :func:`consolidate` (one process, no process group): the original, unwrapped
  layout, e.g. for ``unwrapped.load_state_dict`` or ``save_pretrained``.
* :func:`load_sharded` (every rank, any ``R'``): each rank reads only the rows it owns
  under ``R'`` (files are memory-mapped).
* :func:`load_full` (every rank): from a state dict in the original layout.
* :func:`gather_full_state_dict` (collective, in memory): the original layout on every rank.

File payload: ``{"format": FORMAT, "rank": r, "world_size": R, "experts": {key: (E, lo, hi)},
"state": {key: tensor}}`` (CPU tensors, ``torch.save``; read with ``weights_only=True``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moonplan.adapters.model import sharded_experts
from moonplan.plan.home import home_start, max_local

FORMAT = "moonplan-sharded-v1"
_FILE = re.compile(r"rank-(\d{5})-of-(\d{5})\.pt")
Layout = dict[str, tuple[int, int, int]]  # key -> (E, lo, hi)


def expert_layout(model: nn.Module) -> Layout:
    """``{state-dict key: (E, lo, hi)}`` of every sharded expert tensor of ``model``."""
    layout: Layout = {}
    for name, ex in sharded_experts(model):
        prefix = f"{name}." if name else ""
        for t in ex.expert_tensors:
            layout[prefix + t] = (ex.num_experts, *ex.home_range)
    return layout


def _group_of(model: nn.Module) -> Any:
    for _, ex in sharded_experts(model):
        return ex
    raise ValueError(f"{type(model).__name__} has no wrapped experts (use moonplan.wrap_model)")


def file_name(rank: int, world_size: int) -> str:
    """``rank-{rank:05d}-of-{world_size:05d}.pt``."""
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def save_sharded(model: nn.Module, directory: str | Path) -> Path:
    """Write this rank's part of ``model``'s state (collective: every rank calls it).

    Files of another world size in ``directory`` are removed (by rank 0), so the directory
    always holds one consistent checkpoint. Returns this rank's file.
    """
    ex = _group_of(model)
    r, R = ex.group.rank, ex.group.size
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    layout = expert_layout(model)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items() if k in layout or r == 0}
    path = out / file_name(r, R)
    payload = {"format": FORMAT, "rank": r, "world_size": R, "experts": layout, "state": state}
    torch.save(payload, path)
    if r == 0:
        for stale, (_, world) in _scan(out).items():
            if world != R:
                stale.unlink()
    ex.group.barrier()
    return path


def _scan(directory: Path) -> dict[Path, tuple[int, int]]:
    found: dict[Path, tuple[int, int]] = {}
    for p in directory.iterdir():
        m = _FILE.fullmatch(p.name)
        if m:
            found[p] = (int(m.group(1)), int(m.group(2)))
    return found


def _read_all(directory: str | Path) -> list[dict]:
    """Every rank's payload (memory-mapped), by rank; ValueError if the set is incomplete."""
    d = Path(directory)
    found = _scan(d) if d.is_dir() else {}
    worlds = {w for _, w in found.values()}
    if len(worlds) != 1:
        what = f"world sizes {sorted(worlds)}" if worlds else "no rank-*-of-*.pt files"
        raise ValueError(f"{d} does not hold one sharded checkpoint: found {what}")
    (R,) = worlds
    by_rank = {r: p for p, (r, _) in found.items()}
    missing = sorted(set(range(R)) - set(by_rank))
    if missing:
        raise ValueError(f"{d}: checkpoint of {R} ranks lacks the files of ranks {missing}")
    payloads = []
    for r in range(R):
        data = torch.load(by_rank[r], map_location="cpu", weights_only=True, mmap=True)
        if data.get("format") != FORMAT or data.get("rank") != r:
            raise ValueError(f"{by_rank[r]} is not a {FORMAT} file of rank {r}")
        payloads.append(data)
    return payloads


def _rows(payloads: list[dict], key: str, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of the full expert tensor ``key``, assembled from the saved shards."""
    E = payloads[0]["experts"][key][0]
    parts, covered = [], lo
    for data in payloads:  # ranks hold consecutive, increasing row ranges
        E_s, a, b = data["experts"][key]
        if E_s != E:
            raise ValueError(f"{key}: rank {data['rank']} saved E={E_s}, rank 0 saved E={E}")
        a, b = max(a, covered), min(b, hi)
        if a < b:
            if a != covered:
                raise ValueError(f"{key}: saved shards leave rows [{covered}, {a}) uncovered")
            start = data["experts"][key][1]
            parts.append(data["state"][key][a - start : b - start])
            covered = b
    if covered != hi:
        raise ValueError(f"{key}: saved shards cover rows up to {covered}, need {hi}")
    if not parts:
        return payloads[0]["state"][key][:0]
    return torch.cat(parts, 0)


def consolidate(directory: str | Path) -> dict[str, torch.Tensor]:
    """The original (unwrapped) state dict from a directory written by :func:`save_sharded`.

    Expert tensors become ``[E, ...]``; keys keep rank 0's order. Needs no process group.
    """
    payloads = _read_all(directory)
    layout: Layout = payloads[0]["experts"]
    full = {}
    for key, value in payloads[0]["state"].items():
        full[key] = _rows(payloads, key, 0, layout[key][0]) if key in layout else value.clone()
    return full


def load_sharded(model: nn.Module, directory: str | Path) -> None:
    """Load a sharded checkpoint into a wrapped ``model`` on any number of ranks.

    Every rank calls it; each reads the replicated entries and only its own expert rows.

    Raises:
        ValueError: incomplete checkpoint, or expert counts that differ from the model's.
        RuntimeError: keys or shapes that do not match (``load_state_dict(strict=True)``).
    """
    payloads = _read_all(directory)
    saved: Layout = payloads[0]["experts"]
    state: dict[str, torch.Tensor] = {}
    for key, value in payloads[0]["state"].items():
        if key not in saved:
            state[key] = value
    for key, (E, lo, hi) in expert_layout(model).items():
        if key not in saved or saved[key][0] != E:
            got = saved[key][0] if key in saved else "nothing"
            raise ValueError(f"{key}: the model has {E} experts, the checkpoint {got}")
        state[key] = _rows(payloads, key, lo, hi)
    _load(model, state)


def load_full(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a state dict in the original layout (expert tensors ``[E, ...]``) into a
    wrapped ``model``: every rank keeps its home rows. Every rank calls it."""
    state = dict(state_dict)
    for key, (E, lo, hi) in expert_layout(model).items():
        full = state.get(key)
        if full is None or full.shape[0] != E:
            got = tuple(full.shape) if full is not None else "nothing"
            raise ValueError(f"{key}: expected the full [{E}, ...] tensor, got {got}")
        state[key] = full[lo:hi]
    _load(model, state)


def _load(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    model.load_state_dict(state, strict=True)
    for _, ex in sharded_experts(model):
        ex.weights_changed()


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The original layout, on every rank (collective: every rank calls it).

    Expert tensors are all-gathered over each layer's group (padded to ``ceil(E/R)`` rows);
    the result lives on the group's device.
    """
    experts = dict(sharded_experts(model))
    state = dict(model.state_dict())
    for name, ex in experts.items():
        prefix = f"{name}." if name else ""
        for t in ex.expert_tensors:
            state[prefix + t] = _all_gather_rows(ex, state[prefix + t])
    return state


def _all_gather_rows(ex: Any, home: torch.Tensor) -> torch.Tensor:
    """``[E, ...]`` from every rank's ``[E_r, ...]`` home rows (linear home map)."""
    R, E = ex.group.size, ex.num_experts
    M = max_local(E, R)
    pad = home.new_zeros((M, *home.shape[1:]))
    pad[: home.shape[0]] = home.detach()
    got = ex.group.all_gather(pad)  # [R, M, ...]
    sizes = [home_start(r + 1, E, R) - home_start(r, E, R) for r in range(R)]
    return torch.cat([got[r, : sizes[r]] for r in range(R)], 0)
