"""A plain progress bar for long runs over the calibration samples."""
from __future__ import annotations

import os
import sys
import time


class Progress:
    """A plain ``\\r`` progress bar on stderr, only on a terminal and without QPASSES_NO_PROGRESS."""

    def __init__(self, label: str, total: int | None, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = (stream is not None or (self.stream.isatty() and not os.environ.get("QPASSES_NO_PROGRESS")))
        self.label, self.total, self.start = label, total, time.perf_counter()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        if self.total:
            filled = int(30 * done / self.total)
            bar = f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total}"
        else:
            bar = f"{done}"
        self.stream.write(f"\r{self.label} {bar} {rate:.1f} samples/s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
