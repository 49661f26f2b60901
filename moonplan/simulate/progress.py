"""A dependency-free text progress bar for long sweeps (writes to a stream, stderr by default).

``ProgressBar(stream)`` is callable as ``bar(done, total, label)``, the ``Progress``
callback of :mod:`moonplan.simulate.sweep`. On a terminal it redraws one line with
``\\r``; elsewhere (logs, CI) it prints one line per call.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Callable progress reporter: ``bar(done, total, label)``; ``width`` cells wide."""

    def __init__(self, stream: TextIO | None = None, width: int = 28) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = max(1, int(width))
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, done: int, total: int, label: str) -> None:
        self.stream.write(self.render(done, total, label) + ("\r" if self.tty else "\n"))
        if self.tty and done >= total:
            self.stream.write("\n")
        self.stream.flush()

    def render(self, done: int, total: int, label: str) -> str:
        """One line: bar, ``done/total``, elapsed seconds and the label."""
        frac = min(1.0, done / total) if total > 0 else 1.0
        filled = round(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self.start
        return f"[{bar}] {done}/{total} {elapsed:6.1f}s {label}"
