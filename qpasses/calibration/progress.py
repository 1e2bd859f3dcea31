"""calibrate's progress: the shared qpasses.core.progress.Progress (bar, rate-limited lines, or quiet)."""
from ..core.progress import Progress

__all__ = ["Progress"]
