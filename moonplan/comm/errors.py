"""Errors raised by the communication layer (``moonplan.comm``)."""

from __future__ import annotations


class ContractError(ValueError):
    """A contract violation detected collectively: raised with the same message on every rank.

    Attributes:
        ranks: the ranks whose input broke the contract (ascending).
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)

    def __reduce__(self) -> tuple[type[ContractError], tuple[str, tuple[int, ...]]]:
        return (type(self), (str(self), self.ranks))


class HeapUnavailable(RuntimeError):
    """No symmetric heap spans the group; the message says why.

    Raised on every rank alike, so that the caller can fall back to the all-to-all
    transport (``moonplan.comm.a2a``) explicitly; there is no silent fallback.
    """
