"""Count the host reads and torch ops of one call (the planner's per-step cost on a device).

Legend: none (no tensors are built here; the counted call builds its own).

A *host read* is an op that makes the host wait for a device's data: a scalar read
(``item``, ``int``, ``bool``, ``float`` of a tensor: ``aten._local_scalar_dense``), an op
whose output size depends on values (``nonzero``, ``masked_select``, ``unique``,
``repeat_interleave`` unless given its ``output_size``...),
``torch.equal``, a copy to the CPU, or ``Tensor.tolist`` (which on the CPU reads without
dispatching, so it is counted by wrapping the method). An *op* is any aten op dispatched
while the call runs (on an accelerator, roughly a kernel launch each; views included).
On the CPU nothing waits, but the counts are those the same call makes on a GPU. Only the
calling thread's work counts: a worker thread running beside the call (the placer's
decision, which reads its snapshot on the host by design) is not the call's.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = frozenset(
    {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "unique",
     "_unique2", "unique_consecutive", "repeat_interleave", "item"}
)  # fmt: skip
"""aten op names (overload packet) that read a device's values on the host."""

NO_KERNEL = frozenset(
    {"view", "_unsafe_view", "unsqueeze", "squeeze", "select", "slice", "expand", "t",
     "transpose", "permute", "alias", "as_strided", "detach", "lift_fresh", "scalar_tensor",
     "_reshape_alias", "reshape", "unbind", "split"}
)  # fmt: skip
"""aten ops that only make a view or wrap a Python scalar: no kernel launch on a GPU."""


@dataclass
class HostWork:
    """What one call did: host reads and ops, with the names of each."""

    reads: Counter[str] = field(default_factory=Counter)
    ops: Counter[str] = field(default_factory=Counter)

    @property
    def host_reads(self) -> int:
        return sum(self.reads.values())

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def kernels(self) -> int:
        """Ops that launch work on a device (views and scalar wrappers left out)."""
        return sum(n for op, n in self.ops.items() if op not in NO_KERNEL)


class _Counting(TorchDispatchMode):
    def __init__(self, work: HostWork) -> None:
        super().__init__()
        self.work = work
        self.thread = threading.get_ident()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if threading.get_ident() != self.thread:  # another thread's work, not the call's
            return func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.work.ops[name] += 1
        if (name in SYNC_OPS and not _sized(name, func, args, kwargs)) or (
            name in ("_to_copy", "copy_") and _to_host(args, kwargs)
        ):
            self.work.reads[name] += 1
        return func(*args, **(kwargs or {}))


def _sized(name: str, func: Any, args: Any, kwargs: Any) -> bool:
    """``repeat_interleave`` given its ``output_size``: no read (the size is known)."""
    if name != "repeat_interleave":
        return False
    names = [a.name for a in func._schema.arguments]
    given = dict(zip(names, args, strict=False)) | (kwargs or {})
    return given.get("output_size") is not None


def _to_host(args: Any, kwargs: Any) -> bool:
    """A copy from a non-CPU tensor to the CPU (a device-to-host read)."""
    src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else args[0]
    dst_dev = (kwargs or {}).get("device")
    if len(args) > 1 and isinstance(args[1], torch.Tensor):
        dst_dev = args[0].device
    return src.device.type != "cpu" and dst_dev is not None and torch.device(dst_dev).type == "cpu"


@contextlib.contextmanager
def _count_tolist(work: HostWork) -> Iterator[None]:
    original = torch.Tensor.tolist
    thread = threading.get_ident()

    def tolist(self: torch.Tensor) -> Any:
        if threading.get_ident() == thread:
            work.reads["tolist"] += 1
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


def host_work(fn: Callable[[], Any]) -> HostWork:
    """Run ``fn()`` once and return its :class:`HostWork`."""
    work = HostWork()
    with _count_tolist(work), _Counting(work):
        fn()
    return work
