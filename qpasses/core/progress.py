"""Progress of long steps on stderr: a bar on a terminal, a rate-limited line when stderr is not a
terminal (a log, CI), nothing with QPASSES_NO_PROGRESS (``--quiet`` sets it).

A line is written once the step has run ``interval`` seconds (QPASSES_PROGRESS_INTERVAL, default
10) and then at most every ``interval`` seconds (``calibrate: 32/64 samples, 12 s``), with a last
one when it ends: steps shorter than ``interval`` print nothing.
"""
from __future__ import annotations

import os
import sys
import time

QUIET_ENV = "QPASSES_NO_PROGRESS"
INTERVAL_ENV = "QPASSES_PROGRESS_INTERVAL"
LINE_INTERVAL = 10.0   # seconds between lines when stderr is not a terminal
BAR, LINES = "bar", "lines"


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # closed or not a file
        return False


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, LINE_INTERVAL)))
    except ValueError:
        return LINE_INTERVAL


class Progress:
    """Counts ``done`` of ``total`` (None: unknown) ``unit`` for a step called ``label``.

    ``mode``: ``"bar"``, ``"lines"`` or None (off); by default a bar on a terminal, lines on any
    other stderr, off under QPASSES_NO_PROGRESS. A ``stream`` given explicitly gets the bar."""

    def __init__(self, label: str, total: int | None = None, stream=None, *, unit: str = "samples",
                 mode: str | None = "auto", interval: float | None = None, clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            if stream is not None:
                mode = BAR
            elif os.environ.get(QUIET_ENV):
                mode = None
            else:
                mode = BAR if _isatty(self.stream) else LINES
        self.mode, self.label, self.total, self.unit = mode, label, total, unit
        self.interval, self.clock = _interval() if interval is None else interval, clock
        self.start = clock()
        self.next_line = self.start + self.interval
        self.done, self.lines = 0, 0

    @property
    def enabled(self) -> bool:
        return self.mode is not None

    def update(self, done: int) -> None:
        self.done = done
        if self.mode == BAR:
            self._write(f"\r{self.label} {self._bar(done)} {self._rate(done)}")
        elif self.mode == LINES and self.clock() >= self.next_line:
            self._line()

    def advance(self, step: int = 1) -> None:
        self.update(self.done + step)

    def close(self) -> None:
        if self.mode == BAR:
            self._write("\n")
        elif self.mode == LINES and self.lines:
            self._line(" (done)")
        self.mode = None   # closing twice writes nothing more

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _bar(self, done: int) -> str:
        if not self.total:
            return f"{done}"
        filled = int(30 * min(done, self.total) / self.total)
        return f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total}"

    def _rate(self, done: int) -> str:
        return f"{done / max(self.clock() - self.start, 1e-9):.1f} {self.unit}/s"

    def _line(self, end: str = "") -> None:
        now = self.clock()
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        self._write(f"{self.label}: {count} {self.unit}, {now - self.start:.0f} s{end}\n")
        self.lines += 1
        self.next_line = now + self.interval

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):   # stderr gone: progress is never worth failing a run for
            self.mode = None


def progress(ctx, label: str, total: int | None = None, *, unit: str = "samples") -> Progress:
    """The progress of a pass's long step: shown for the user's pipeline only, not for the copies a
    pass quantizes in a nested pipeline (``ctx.depth`` > 0)."""
    return Progress(label, total, unit=unit, mode="auto" if getattr(ctx, "depth", 0) == 0 else None)
