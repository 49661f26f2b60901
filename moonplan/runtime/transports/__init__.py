"""Transports: everything a MoE step moves between ranks, behind one protocol.

Legend: none (see :mod:`moonplan.runtime.transports.base`).

``Transport`` (the protocol), ``RecvView``, ``StepState``, ``StaleViewError``;
the built-in ``HeapTransport`` and ``AllToAllTransport`` (one row per record) and
``HeapTokenTransport`` and ``AllToAllTokenTransport`` (one row per token and
destination rank), ``TwoStageTokenTransport`` (once per destination host); and the
name registry (``register``, ``create``, ``names``).
"""

from moonplan.runtime.transports.all_to_all import AllToAllTokenTransport, AllToAllTransport
from moonplan.runtime.transports.base import (
    RecvView,
    SharedRows,
    StaleViewError,
    StepState,
    Transport,
)
from moonplan.runtime.transports.heap import HeapTokenTransport, HeapTransport
from moonplan.runtime.transports.registry import check, create, names, needs_heap, register
from moonplan.runtime.transports.two_stage import TwoStageTokenTransport

__all__ = [
    "AllToAllTokenTransport",
    "AllToAllTransport",
    "HeapTokenTransport",
    "HeapTransport",
    "RecvView",
    "SharedRows",
    "StaleViewError",
    "StepState",
    "Transport",
    "TwoStageTokenTransport",
    "check",
    "create",
    "names",
    "needs_heap",
    "register",
]
