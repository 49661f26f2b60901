"""Transports: everything a MoE step moves between ranks, behind one protocol.

Legend: none (see :mod:`moonplan.runtime.transports.base`).

``Transport`` (the protocol), ``RecvView``, ``StepState``, ``StaleViewError``;
the built-in ``HeapTransport`` and ``AllToAllTransport``; and the name registry
(``register``, ``create``, ``names``).
"""

from moonplan.runtime.transports.all_to_all import AllToAllTransport
from moonplan.runtime.transports.base import (
    RecvView,
    SharedRows,
    StaleViewError,
    StepState,
    Transport,
)
from moonplan.runtime.transports.heap import HeapTransport
from moonplan.runtime.transports.registry import check, create, names, needs_heap, register

__all__ = [
    "AllToAllTransport",
    "HeapTransport",
    "RecvView",
    "SharedRows",
    "StaleViewError",
    "StepState",
    "Transport",
    "check",
    "create",
    "names",
    "needs_heap",
    "register",
]
