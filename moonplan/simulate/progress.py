"""Progress with an ETA for long runs (simulator sweeps, the demo), on stderr by default.

``ProgressBar(stream)`` is callable as ``bar(done, total, label)``, the ``Progress``
callback of :mod:`moonplan.simulate.sweep`. On a terminal it is a ``rich`` progress bar
(bar, ``done/total``, elapsed, estimated time left, label) that redraws in place; when the
stream is not a terminal (pipes, logs, CI, tests) it writes one plain line per call:
``[done/total] elapsed 1.2s, ETA 3.4s: label``. The ETA assumes the remaining items take
as long as the finished ones on average.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class ProgressBar:
    """Callable progress reporter: ``bar(done, total, label)``; stops itself at ``done >= total``.

    Args:
        stream: where to write (default ``sys.stderr``).
        description: a word before the bar (terminal) or before each line (plain).
        tty: force the terminal (``True``) or plain (``False``) form; default: ask the stream.
    """

    def __init__(
        self, stream: TextIO | None = None, description: str = "", tty: bool | None = None
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.description = description
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self._live: Any = None
        self._task: Any = None
        self._last = -1

    def __call__(self, done: int, total: int, label: str) -> None:
        if done < self._last:  # a new sequence (e.g. the next break-even search): new clock
            self.close()
            self.start = time.monotonic()
        self._last = done
        if self.tty:
            self._draw(done, total, label)
        else:
            self.stream.write(self.render(done, total, label) + "\n")
            self.stream.flush()

    def eta(self, done: int, total: int) -> float | None:
        """Seconds left at the average pace so far (``None`` before the first item)."""
        if done <= 0 or total <= 0:
            return None
        elapsed = time.monotonic() - self.start
        return max(0.0, elapsed / done * (total - done))

    def render(self, done: int, total: int, label: str) -> str:
        """The plain line: ``[done/total] elapsed, ETA: label``."""
        elapsed = time.monotonic() - self.start
        left = self.eta(done, total)
        eta = "?" if left is None else _seconds(left)
        head = f"{self.description} " if self.description else ""
        return f"{head}[{done}/{total}] elapsed {_seconds(elapsed)}, ETA {eta}: {label}"

    def _draw(self, done: int, total: int, label: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        if self._live is None:
            console = Console(file=self.stream, force_terminal=True)
            self._live = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[label]}"),
                console=console,
                transient=False,
            )
            self._live.start()
            self._task = self._live.add_task(self.description, total=total, label=label)
        self._live.update(self._task, completed=done, total=total, label=label)
        if done >= total:
            self.close()

    def close(self) -> None:
        """Stop the terminal bar (idempotent; nothing to do in plain mode)."""
        if self._live is not None:
            self._live.stop()
            self._live = None


def _seconds(s: float) -> str:
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(round(s), 60)
    return f"{m}m{sec:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"
