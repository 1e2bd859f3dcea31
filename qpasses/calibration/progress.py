"""calibrate's progress: the shared qpasses.progress.Progress (bar, rate-limited lines, or quiet)."""
from ..progress import Progress

__all__ = ["Progress"]
