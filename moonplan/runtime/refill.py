"""Refill one layer's resident slots beside the steps: stage, agree, commit.

Legend:
    R ranks, E experts, B slots per rank, S staging rows per rank, J slots one refill
    changes on this rank (``J <= S``), W = ``STATUS_WORDS`` int64 words of refill status
    per rank in the counts exchange
    slot_RB    int64 ``[R, B]`` the expert in each slot (``-1``: empty)
    target_RB  int64 ``[R, B]`` the slots a refill asks for (``-1``: keep what is there)

A refill (:meth:`LayerRuntime.request_refill`, on every rank alike between steps) is one job
on the layer's background lane that copies this rank's changed slots' experts from their
home rows into the store's staging rows (:meth:`ExpertStore.stage`), never into the slot
rows the steps read. The staging rows are shared by every layer of the same shapes on the
device (:mod:`moonplan.runtime.staging`): a refill holds them until its commit or drop, and
another layer's refill waits until then. Each step's counts exchange carries every rank's
status (:meth:`Refill.status_words`, a poll that never blocks): where every rank is done the
step copies the staging rows into the slots before it plans (:meth:`Refill.commit`) and
plans with those slots resident; where any rank failed every rank drops it and warns
(:func:`agree`); otherwise the old slots keep serving. Everything is decided from
all-gathered data, so every rank commits or drops at the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from moonplan.plan.residency.refill import swap_in
from moonplan.plan.residency.serving import check_slots
from moonplan.runtime.background import BackgroundLane, Pending
from moonplan.runtime.fetch_list import FetchList, HomeRows
from moonplan.runtime.staging import StagingPool

NONE, IN_FLIGHT, DONE, FAILED = 0, 1, 2, 3
"""A rank's refill status: none requested, copying, copied, copy failed."""

TEXT_BYTES = 120
"""Bytes of a failed copy's error text (UTF-8, truncated) that reach every rank."""

STATUS_WORDS = 1 + TEXT_BYTES // 8
"""int64 words per rank in the counts exchange: the status, then the error text."""


def changed_slots(target_RB: Tensor, current_RB: Tensor) -> list[tuple[int, ...]]:
    """Per rank, the slots ``j`` (ascending) a refill changes: ``target[r][j] >= 0`` and
    ``!= current[r][j]`` (both int64 ``[R, B]``)."""
    out = []
    for t, c in zip(target_RB.cpu().tolist(), current_RB.cpu().tolist(), strict=True):
        out.append(tuple(j for j, (e, old) in enumerate(zip(t, c, strict=True)) if 0 <= e != old))
    return out


def refilled_slots(current_RB: Tensor, target_RB: Tensor, changed: list[tuple[int, ...]]) -> Tensor:
    """The slots after a commit (int64 ``[R, B]``, on the host): ``current`` with each
    changed slot holding its target expert, and any other slot of the same rank that held
    one of those experts (a step's plan put it there meanwhile) emptied, so that no rank
    holds an expert twice."""
    changed_RB = torch.zeros(current_RB.shape, dtype=torch.bool)
    for r, slots in enumerate(changed):
        changed_RB[r, list(slots)] = True
    return swap_in(current_RB, target_RB, changed_RB)


def check_target(
    target_RB: object, current_RB: Tensor, *, num_experts: int, staging_rows: int
) -> list[tuple[int, ...]]:
    """Each rank's changed slots (:func:`changed_slots`) of a valid refill target.

    Raises:
        ValueError: ``target`` is not an integer tensor ``[R, B]`` (the shape of
            ``current``), breaks a slot table's invariants
            (:func:`moonplan.plan.residency.serving.check_slots`, a ``PlanError``), or
            changes more than ``staging_rows`` slots on some rank (naming each).
    """
    R, B = current_RB.shape
    if not isinstance(target_RB, Tensor) or target_RB.is_floating_point() or target_RB.is_complex():
        raise ValueError(
            f"refill target must be an integer tensor [R={R}, B={B}], got {target_RB!r}"
        )
    if tuple(target_RB.shape) != (R, B):
        raise ValueError(f"refill target must be [R={R}, B={B}], got {tuple(target_RB.shape)}")
    target_RB = target_RB.to("cpu", torch.int64)
    if bool((target_RB < -1).any()):
        raise ValueError("refill target: a slot is an expert id >= 0 or -1 (keep)")
    check_slots(target_RB, R, num_experts)
    changed = changed_slots(target_RB, current_RB)
    over = [(r, len(c)) for r, c in enumerate(changed) if len(c) > staging_rows]
    if over:
        named = "; ".join(f"rank {r}: {n}" for r, n in over)
        raise ValueError(
            f"refill target changes more slots than the {staging_rows} staging rows per rank "
            f"(refill_rows) on {named}"
        )
    return changed


@dataclass
class _Job:
    """The refill in flight: its target, each rank's changed slots, this rank's copy."""

    target_RB: Tensor
    changed: list[tuple[int, ...]]
    pending: Pending
    pool: StagingPool


class Refill:
    """One layer's refill state: at most one refill in flight (module docstring).

    Args:
        rank: this rank; home: every expert's home rank and row.

    Attributes:
        commits, drops: refills committed and dropped so far (every rank alike).
    """

    def __init__(self, rank: int, home: HomeRows):
        self.rank, self.home = rank, home
        self._job: _Job | None = None
        self.commits = self.drops = 0

    @property
    def in_flight(self) -> bool:
        """Whether a refill was started and neither committed nor dropped yet."""
        return self._job is not None

    def start(
        self,
        target_RB: Tensor,
        changed: list[tuple[int, ...]],
        stage: Callable[[FetchList], int],
        lane: BackgroundLane,
        *,
        pool: StagingPool,
        collective: bool,
    ) -> None:
        """Start copying this rank's changed slots into staging rows (``stage``, on
        ``lane`` as a job that outlives the steps), holding the shared ``pool`` until the
        commit or drop. Every rank starts it where any rank changes a slot and the copy is
        ``collective`` (all-to-all); on a one-sided transport a rank with nothing to copy
        starts no job and is done at once.

        Raises:
            RuntimeError: another layer's refill holds ``pool``.
        """
        mine = changed[self.rank]
        if not any(changed):
            return
        e_J = [int(target_RB[self.rank, j]) for j in mine]
        fetch = FetchList(
            mine,
            tuple(self.home.rank_E[e] for e in e_J),
            tuple(self.home.row_E[e] for e in e_J),
            (),
            (),
            True,
        )
        pool.acquire(self)
        try:
            if mine or collective:
                pending = lane.submit(lambda: _attempt(stage, fetch), step=False)
            else:
                pending = Pending(result="")
        except BaseException:
            pool.release(self)  # no job holds the rows: another layer may take them
            raise
        self._job = _Job(target_RB.to("cpu", torch.int64), changed, pending, pool)

    def status_words(self, device: torch.device) -> Tensor:
        """int64 ``[W]``: this rank's status (``NONE``, ``IN_FLIGHT``, ``DONE``,
        ``FAILED``) and a failure's error text; a poll, it never blocks."""
        code, text = NONE, ""
        if self._job is not None:
            pending = self._job.pending
            code = IN_FLIGHT
            if pending.finished():
                text = pending.wait()  # at once (on CUDA: the stream waits for its event)
                code = FAILED if text else DONE
        return torch.tensor([code, *_encode(text)], dtype=torch.int64, device=device)

    def commit(self, commit: Callable[[tuple[int, ...]], None], current_RB: Tensor) -> Tensor:
        """Copy the staging rows into this rank's changed slots (``commit``, between steps)
        and return the slots now (:func:`refilled_slots` of ``current``)."""
        job = self._job
        assert job is not None and job.pending.finished()
        job.pending.wait()
        commit(job.changed[self.rank])
        self._job = None
        job.pool.release(self)
        self.commits += 1
        return refilled_slots(current_RB, job.target_RB, job.changed)

    def drop(self) -> None:
        """Forget the refill in flight, if any, once its copy has ended (waits for it: its
        staging rows may be reused and the rows it reads republished)."""
        job, self._job = self._job, None
        if job is not None:
            job.pending.wait()
            job.pool.release(self)
            self.drops += 1


def agree(status_RW: np.ndarray | Tensor) -> tuple[str, str]:
    """Every rank's decision from the all-gathered statuses (int64 ``[R, W]``, already on
    the host: no read of its own): ``("none", "")`` no refill, ``("wait", "")`` some copy
    still runs, ``("commit", "")`` every rank is done, ``("drop", why)`` some rank failed
    (or has none: never from one request), ``why`` naming each such rank and its error."""
    status = np.asarray(status_RW, dtype=np.int64)
    codes = status[:, 0].tolist()
    if all(c == NONE for c in codes):
        return "none", ""
    bad = [r for r, c in enumerate(codes) if c in (NONE, FAILED)]
    if bad:
        why = "; ".join(
            f"rank {r}: {_decode(status[r, 1:]) if codes[r] == FAILED else 'no refill'}"
            for r in bad
        )
        return "drop", why
    return ("commit", "") if all(c == DONE for c in codes) else ("wait", "")


def _attempt(stage: Callable[[FetchList], int], fetch: FetchList) -> str:
    """The refill job: ``stage(fetch)``; ``""``, or the error it raised as text (a
    failed copy is reported in the next counts exchange, not raised in a step)."""
    try:
        stage(fetch)
    except Exception as exc:  # reported to every rank, which drop the refill
        return f"{type(exc).__name__}: {exc}"
    return ""


def _encode(text: str) -> list[int]:
    """``TEXT_BYTES // 8`` int64 words holding ``text`` (UTF-8, truncated, zero padded)."""
    data = text.encode()[:TEXT_BYTES].ljust(TEXT_BYTES, b"\0")
    return torch.frombuffer(bytearray(data), dtype=torch.int64).tolist()


def _decode(words_W: np.ndarray) -> str:
    """The text of :func:`_encode`'s words (int64 ``[W - 1]``, host)."""
    data = np.ascontiguousarray(words_W, dtype="<i8").tobytes()
    return data.rstrip(b"\0").decode(errors="ignore") or "(no message)"
