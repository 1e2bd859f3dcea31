"""Memory figures of the current process for the benchmark children."""
from __future__ import annotations

import resource


def status_mb(key: str) -> float:
    """A ``/proc/self/status`` memory line in MB (``VmHWM``: peak RSS, ``VmRSS``: current RSS).

    VmHWM starts afresh at exec; getrusage's ru_maxrss of a spawned child also counts the parent's
    RSS at fork time (Linux carries it across exec), so it is only the fallback off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0 if key == "VmHWM" else 0.0


def peak_rss_mb() -> float:
    return status_mb("VmHWM")
