"""``EPGroup``: the expert-parallel process group, its device, and collective error agreement.

Legend:
    R  ranks in the group
    L  bytes of one encoded status (``STATUS_BYTES``: ok flag, length, message)

A contract violation seen by one rank must raise the same error on every rank
(see ``docs/reliability.md``): :meth:`EPGroup.agree`, :meth:`EPGroup.check_same`,
:meth:`EPGroup.check_settings` and :meth:`EPGroup.gather_with_status` all-gather a
fixed-size status, so every rank takes the same decision from the same bytes and
builds the same message.

Without ``torch.distributed`` (not initialised, ``group=None``) the group is a
single rank that never communicates; every method still works.

:meth:`EPGroup.background_group` gives a second group over the same ranks, on its
own ``torch.distributed`` process group: collectives issued from a worker thread go
there, so each process group sees its collectives in one order on every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from moonplan.comm.errors import ContractError

MESSAGE_BYTES = 512  # longest status message carried (UTF-8, truncated beyond)
_LEN_BYTES = 2
STATUS_BYTES = 1 + _LEN_BYTES + MESSAGE_BYTES  # L
_DIGEST_BYTES = 16
_VALUE_TEXT_BYTES = 160  # how much of a config value's repr the error message shows
_SETTINGS_BYTES = 16384  # most bytes of one rank's settings (check_settings), as JSON


class EPGroup:
    """A ``torch.distributed`` process group plus this rank's device.

    Args:
        group: the process group; ``None`` means the default group when
            ``torch.distributed`` is initialised, else a single-rank group with no
            communication.
        device: device of the tensors this group communicates; default ``cpu`` for
            gloo (and the single-rank group), ``cuda:{local rank}`` for NCCL
            (``LOCAL_RANK`` if set, else ``rank % device_count``).
        background: a second process group over the same ranks (same order) for the
            layers' background collectives (:meth:`background_group`), created by the
            caller on every rank (``dist.new_group(ranks)``, as ``group`` was). Needed
            only to overlap the all-to-all transports' prefetch when ``group`` does not
            span the whole world; moonplan never destroys it.

    Attributes:
        group: the wrapped ``ProcessGroup`` (``None`` for the single-rank group).
        rank: this rank's index in the group, ``0 <= rank < size``.
        size: ``R``.
        backend: ``"gloo"``, ``"nccl"``, ... as torch reports it; ``"local"`` without dist.
        device: the communication device.
    """

    def __init__(
        self, group: Any = None, device: torch.device | str | None = None, *, background: Any = None
    ):
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        if group is None:
            self.rank, self.size, self.backend = 0, 1, "local"
        else:
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group))
            if self.rank < 0:
                raise ValueError("this process is not a member of the given process group")
        self.device = torch.device(device) if device is not None else self._default_device()
        self._owned = False  # close() destroys the process group (background_group)
        self._given = background  # the caller's second group (background_group)
        self._shared: EPGroup | None = None  # the background group handed out
        self._users = 0  # holders of _shared (background_group / release_background)
        if background is not None and self.group is not None:
            given, ours = list(dist.get_process_group_ranks(background)), self.ranks()
            if given != ours:
                raise ValueError(
                    f"background group ranks {given} differ from the EP group's {ours}"
                )

    def _default_device(self) -> torch.device:
        if "nccl" in self.backend and torch.cuda.is_available():
            local = os.environ.get("LOCAL_RANK")
            index = int(local) if local is not None else self.rank % torch.cuda.device_count()
            return torch.device("cuda", index)
        return torch.device("cpu")

    def __repr__(self) -> str:
        return (
            f"EPGroup(rank={self.rank}, size={self.size}, backend={self.backend!r}, "
            f"device={self.device})"
        )

    # ---- a second process group ---------------------------------------------------
    def ranks(self) -> list[int]:
        """The global ranks of the group, in group order (``[0]`` without dist)."""
        return [0] if self.group is None else list(dist.get_process_group_ranks(self.group))

    def background_group(self) -> EPGroup | None:
        """A second ``EPGroup`` over the same ranks, in the same order, with the same
        backend and device, on its own process group, for collectives issued from a
        worker thread beside this group's (the all-to-all transports' prefetch and
        replica-gradient reduce); ``None`` where none is available. Release each call
        with :meth:`release_background`. The single-rank group needs none and returns
        itself (it never communicates).

        Every layer built on this ``EPGroup`` shares the one it hands out (each layer
        waits for its own background job inside its own forward or backward, so their
        collectives on it never overlap, and they are issued in program order, the same
        on every rank): one process group in all, not one per layer.

        * The group given as ``background=`` at construction, if any (never destroyed).
        * Else, a group spanning the whole world: created here by every rank, at the
          same point (collective; the first holder's call, ``dist.new_group`` with the
          same timeout), destroyed when the last holder releases it.
        * Else ``None``: a group of fewer ranks is not created here. ``new_group`` would
          need every rank of the world, or (``use_local_synchronization=True``, members
          only) it names the group from the number of process groups each process holds,
          so members that hold different numbers of groups (a pipeline stage's group,
          any group of some ranks) wait under different names and hang. Pass
          ``background=`` instead.
        """
        if self.group is None or self.size == 1:
            return self
        if self._shared is None:
            self._shared = self._new_background()
            if self._shared is None:
                return None
        self._users += 1
        return self._shared

    def _new_background(self) -> EPGroup | None:
        if self._given is not None:
            return EPGroup(self._given, self.device)
        if self.size != dist.get_world_size():
            return None
        timeout = _timeout_of(self.group, self.device)
        if timeout is None:
            warnings.warn(
                "this torch does not expose the EP group's collective timeout: its "
                "background group takes torch's default (30 minutes for gloo)",
                RuntimeWarning,
                stacklevel=3,
            )
        pg = dist.new_group(ranks=self.ranks(), timeout=timeout, backend=self.backend)
        # Every rank has finished connecting before any uses or destroys the group: gloo's
        # new_group can return on one rank while a peer still connects, and a rank whose
        # transport declines the group releases it at once, closing the peer's connections.
        dist.barrier(group=pg)
        other = EPGroup(pg, self.device)
        other._owned = True
        return other

    def release_background(self) -> None:
        """Give back one :meth:`background_group`; the last release destroys a group this
        ``EPGroup`` created (collective then: every rank releases alike). Extra calls do
        nothing."""
        if self._users == 0:
            return
        self._users -= 1
        if self._users == 0 and self._shared is not None:
            self._shared.close()
            self._shared = None

    def close(self) -> None:
        """Destroy the process group if :meth:`background_group` created it (see there);
        otherwise nothing. Safe to call twice."""
        if self._owned and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self._owned = False

    # ---- collectives -------------------------------------------------------------
    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[R, *t.shape]``: every rank's ``t`` (same shape and dtype on every rank).

        ``t`` is moved to :attr:`device` if it lives elsewhere; the result lives there.
        """
        x = t.to(self.device).contiguous()
        if self.size == 1:
            return x.unsqueeze(0).clone()
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1), x.view(-1), group=self.group)
        return out

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
    ) -> None:
        """``all_to_all_single`` along dim 0 with unequal splits (lists of ``R`` ints).

        ``input[sum(input_splits[:r]) : ...]`` goes to rank ``r``; the rows from rank ``s``
        land in ``output[sum(output_splits[:s]) : ...]``.
        """
        if self.size == 1:
            if list(output_splits) != list(input_splits):
                raise ValueError(f"single rank: splits differ {output_splits} vs {input_splits}")
            output.copy_(input)
            return
        dist.all_to_all_single(
            output, input, list(output_splits), list(input_splits), group=self.group
        )

    def barrier(self) -> None:
        """Block until every rank of the group has reached this point."""
        if self.size == 1:
            return
        if self.device.type == "cuda":
            dist.barrier(group=self.group, device_ids=[self.device.index or 0])
        else:
            dist.barrier(group=self.group)

    def all_gather_bytes(self, data: bytes, max_len: int) -> list[bytes]:
        """Every rank's ``data`` (at most ``max_len`` bytes, longer raises ValueError)."""
        if len(data) > max_len:
            raise ValueError(f"{len(data)} bytes exceed max_len={max_len}")
        g_RL = self.all_gather(_pack_bytes(data, max_len, self.device)).cpu()
        return [_unpack_bytes(g_RL[r]) for r in range(self.size)]

    # ---- error agreement ----------------------------------------------------------
    def agree(self, ok: bool, message: str = "", *, what: str = "") -> None:
        """Collective: raise :class:`ContractError` on every rank if any rank is not ``ok``.

        Args:
            ok: whether this rank's input satisfies the contract.
            message: why not (UTF-8, truncated to 512 bytes); ignored when ``ok``.
            what: the checked operation, prefixed to the error message.

        Raises:
            ContractError: the same message on every rank, naming each failing rank
                and its message.
        """
        status_L = encode_status(ok, message, self.device)
        raise_if_failed(self.all_gather(status_L).cpu(), what)

    def gather_with_status(self, t: torch.Tensor, ok: bool, message: str = "") -> torch.Tensor:
        """One all-gather carrying ``t`` and this rank's status: ``[R, *t.shape]``.

        ``t`` must have the same shape and dtype on every rank, even where ``ok`` is
        false (its content is then ignored by the caller). Validation thus costs no extra
        collective: raises :class:`ContractError` on every rank if any rank is not ``ok``.
        """
        x = t.to(self.device).contiguous()
        data_B = x.reshape(-1).view(torch.uint8)
        nbytes = data_B.numel()
        packed = torch.cat([data_B, encode_status(ok, message, self.device)])
        g_RX = self.all_gather(packed)
        raise_if_failed(g_RX[:, nbytes:].cpu(), "")
        if nbytes == 0:
            return x.new_empty((self.size, *x.shape))
        return dense(g_RX[:, :nbytes]).view(x.dtype).view(self.size, *x.shape)

    def outcome(self, what: str, exc: BaseException | None) -> None:
        """Collective: every rank's outcome of the same local work (``exc``: what it raised,
        ``None``: it succeeded). Returns where every rank succeeded; raises ``exc`` itself
        where every rank failed with the same type and message (the error one process
        would see), else the same :class:`ContractError` on every rank naming each failing
        rank and its error."""
        text = "" if exc is None else f"{type(exc).__name__}: {exc}"
        status_RL = self.all_gather(encode_status(exc is None, text, self.device)).cpu()
        _raise_outcome(status_RL, what, exc)

    def check_same(self, name: str, value: int | float | tuple | str) -> None:
        """Collective: raise :class:`ContractError` on every rank unless ``value`` is identical
        on all ranks (compared through a digest of its type and ``repr``).

        The message groups the ranks by value, e.g.
        ``config 'experts' differs across ranks: rank 0, 2: 8; rank 1: 9``; the error's
        ``ranks`` are those outside the largest group (ties: the group of the lowest rank).
        """
        text = f"{type(value).__name__}:{value!r}"
        digest = hashlib.blake2b(text.encode(), digest_size=_DIGEST_BYTES).digest()
        shown = _truncate_utf8(repr(value), _VALUE_TEXT_BYTES)
        rows = self.all_gather_bytes(digest + shown, _DIGEST_BYTES + _VALUE_TEXT_BYTES)
        groups: dict[bytes, list[int]] = {}
        for r, row in enumerate(rows):
            groups.setdefault(row[:_DIGEST_BYTES], []).append(r)
        if len(groups) == 1:
            return
        parts = [
            f"rank {', '.join(map(str, ranks))}: {rows[ranks[0]][_DIGEST_BYTES:].decode()}"
            for ranks in groups.values()
        ]
        reference = max(groups.values(), key=lambda ranks: (len(ranks), -ranks[0]))
        others = tuple(r for r in range(self.size) if r not in reference)
        raise ContractError(f"config {name!r} differs across ranks: " + "; ".join(parts), others)

    def check_settings(self, what: str, settings: Mapping[str, object]) -> None:
        """Collective: raise the same :class:`ContractError` on every rank unless every rank
        gave the same ``settings`` (compared by type and ``repr``), and no rank called
        :meth:`fail_settings` instead.

        One all-gather carries this rank's status and a digest of its settings; only
        where the digests differ does a second one carry the settings themselves, so that
        the message names each differing setting with its value on every rank, e.g.
        ``layer config differs across ranks in 1 setting: balance (rank 0: 'exact';
        rank 1: 'off')``. The error's ``ranks``: those whose settings differ from the
        largest group's (ties: the lowest rank's group).
        """
        texts = {name: _setting_text(value) for name, value in settings.items()}
        digest = hashlib.blake2b(repr(sorted(texts.items())).encode(), digest_size=_DIGEST_BYTES)
        digests = self._settings_round(what, digest.digest(), None)
        if len(set(digests)) == 1:
            return
        data = json.dumps(texts).encode()  # every rank is here: the digests are everyone's
        if len(data) > _SETTINGS_BYTES:  # never raise on one rank only
            note = f"str:{len(texts)} settings, too long to show"
            data = json.dumps({"(settings)": note}).encode()
        rows = self.all_gather_bytes(data, _SETTINGS_BYTES)
        raise _differing(what, [json.loads(row) for row in rows], digests)

    def fail_settings(self, what: str, exc: BaseException) -> NoReturn:
        """Collective: the counterpart of :meth:`check_settings` for a rank that could not
        produce its settings because ``exc`` was raised (e.g. an invalid option, a value
        from the environment that cannot be used). Every rank then raises the same error:
        ``exc`` itself where every rank failed with the same type and message (the error
        the user would see on one rank), else a :class:`ContractError` naming each failing
        rank and its error.
        """
        self._settings_round(what, b"", exc)
        raise AssertionError("unreachable: _settings_round raises for a failing rank")

    def _settings_round(self, what: str, digest: bytes, exc: BaseException | None) -> list[bytes]:
        """The first collective of :meth:`check_settings` / :meth:`fail_settings`: every
        rank's status and settings digest; raises where any rank failed."""
        text = "" if exc is None else f"{type(exc).__name__}: {exc}"
        mine = torch.cat(
            [
                encode_status(exc is None, text, self.device),
                _pack_bytes(digest, _DIGEST_BYTES, self.device),
            ]
        )
        got_RX = self.all_gather(mine).cpu()
        _raise_outcome(got_RX[:, :STATUS_BYTES], what, exc)
        return [_unpack_bytes(row) for row in got_RX[:, STATUS_BYTES:]]


def _raise_outcome(status_RL: torch.Tensor, what: str, exc: BaseException | None) -> None:
    """Raise for every rank's status ``[R, L]`` (CPU uint8) as :meth:`EPGroup.outcome` says."""
    texts = {_unpack_bytes(row) for row in status_RL}
    everyone = not any(status_RL[:, 0].tolist())
    if exc is not None and everyone and len(texts) == 1:
        raise exc  # the same error on every rank: the user's own, not a wrapped one
    raise_if_failed(status_RL, what)


def _setting_text(value: object) -> str:
    """``type:repr`` of a setting, cut to ``_VALUE_TEXT_BYTES`` bytes (its digest is of
    the whole text)."""
    text = f"{type(value).__name__}:{value!r}"
    if len(text.encode()) <= _VALUE_TEXT_BYTES:
        return text
    tail = hashlib.blake2b(text.encode(), digest_size=4).hexdigest()
    return _truncate_utf8(text, _VALUE_TEXT_BYTES - 12).decode() + f"...#{tail}"


def _differing(what: str, settings_R: list[dict[str, str]], digests: list[bytes]) -> ContractError:
    """The error of :meth:`EPGroup.check_settings`: each setting whose text differs across
    ranks (or that some rank lacks), with every rank's value, ranks grouped by value."""
    names = sorted({name for s in settings_R for name in s})
    parts = []
    for name in names:
        groups: dict[str, list[int]] = {}
        for r, s in enumerate(settings_R):
            groups.setdefault(s.get(name, "(not set)"), []).append(r)
        if len(groups) > 1:
            shown = "; ".join(
                f"rank {', '.join(map(str, ranks))}: {text.split(':', 1)[-1]}"
                for text, ranks in groups.items()
            )
            parts.append(f"{name} ({shown})")
    by_digest: dict[bytes, list[int]] = {}
    for r, d in enumerate(digests):
        by_digest.setdefault(d, []).append(r)
    reference = max(by_digest.values(), key=lambda ranks: (len(ranks), -ranks[0]))
    others = tuple(r for r in range(len(digests)) if r not in reference)
    count = f"{len(parts)} setting{'s' if len(parts) != 1 else ''}"
    return ContractError(f"{what} differs across ranks in {count}: " + ", ".join(parts), others)


def _timeout_of(group: Any, device: torch.device) -> Any:
    """The collective timeout of ``group``'s backend on ``device`` (a ``timedelta``), or
    ``None`` (torch's default) where this torch does not expose it."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def dense(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with standard contiguous strides (``contiguous()`` keeps the odd
    strides of size-1 dimensions, which ``view(dtype)`` then rejects)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


# ---- status encoding (module functions: shared by group-level helpers) ------------
def encode_status(ok: bool, message: str, device: torch.device) -> torch.Tensor:
    """``[L]`` uint8: ok flag, 2-byte length, message (UTF-8, at most 512 bytes)."""
    return _pack_bytes(
        b"" if ok else _truncate_utf8(message, MESSAGE_BYTES), MESSAGE_BYTES, device, ok
    )


def raise_if_failed(status_RL: torch.Tensor, what: str) -> None:
    """Raise :class:`ContractError` if any row of ``status [R, L]`` (CPU uint8) is not ok."""
    flags = status_RL[:, 0].tolist()
    bad = [r for r, flag in enumerate(flags) if flag == 0]
    if not bad:
        return
    details = "; ".join(
        f"rank {r}: {_unpack_bytes(status_RL[r]).decode() or '(no message)'}" for r in bad
    )
    prefix = f"{what}: " if what else ""
    ranks = ", ".join(map(str, bad))
    raise ContractError(f"{prefix}contract violated on rank {ranks}: {details}", tuple(bad))


def _pack_bytes(data: bytes, max_len: int, device: torch.device, flag: bool = True) -> torch.Tensor:
    """``[1 + 2 + max_len]`` uint8: flag, little-endian length, data, zero padding."""
    buf = bytearray(1 + _LEN_BYTES + max_len)
    buf[0] = 1 if flag else 0
    buf[1 : 1 + _LEN_BYTES] = len(data).to_bytes(_LEN_BYTES, "little")
    buf[1 + _LEN_BYTES : 1 + _LEN_BYTES + len(data)] = data
    return torch.frombuffer(buf, dtype=torch.uint8).clone().to(device)


def _unpack_bytes(row: torch.Tensor) -> bytes:
    raw = bytes(row.tolist())
    n = int.from_bytes(raw[1 : 1 + _LEN_BYTES], "little")
    return raw[1 + _LEN_BYTES : 1 + _LEN_BYTES + n]


def _truncate_utf8(text: str, max_bytes: int) -> bytes:
    """``text`` as UTF-8, cut to ``max_bytes`` without splitting a character."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return data
    return data[:max_bytes].decode("utf-8", errors="ignore").encode("utf-8")
