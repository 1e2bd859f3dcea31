"""Jobs on a small thread pool, results in the jobs' order so that what is made of them does not
depend on the threads: weights quantized (numpy releases the GIL in its array loops), feeds run
in one-thread onnxruntime sessions (evaluate.run_feeds)."""
from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import islice

MAX_THREADS = 4
THREADS = 0   # 0: one per CPU this process may run on (at most MAX_THREADS); 1: no pool
MIN_VALUES = 1 << 22   # fewer weight values than this run inline (a pool cost more than it saved)


def thread_count(values: int | None = None) -> int:
    """Threads for jobs of ``values`` values in all (None: as if many): one per CPU this process
    may run on, less the CPUs other threads of the machine keep busy right now (a worker waiting for
    the GIL held by a thread the scheduler has put aside stalls: on 2 CPUs with one busy, the decoder
    of tools/bench_formats.py took 77 ms on two threads against 59 ms on one)."""
    if THREADS:
        return THREADS
    if values is not None and values < MIN_VALUES:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:   # no affinity on this platform
        cpus = os.cpu_count() or 1
    free = (os.cpu_count() or cpus) - others_running()
    return max(1, min(MAX_THREADS, cpus, free))


def others_running() -> int:
    """Threads of the machine runnable now besides this one (Linux /proc/loadavg; 0 if unknown)."""
    try:
        with open("/proc/loadavg") as f:
            return max(0, int(f.read().split()[3].split("/")[0]) - 1)
    except (OSError, ValueError, IndexError):
        return 0


def in_order(jobs: list, fn, values: int | None = None):
    """Yield fn(job) for each job, in order. At most thread_count(values) run at once and one more
    result waits, so the jobs in flight (and their temporaries) stay bounded."""
    threads = thread_count(values)
    if threads == 1 or len(jobs) < 2:
        for job in jobs:
            yield fn(job)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="qpasses") as pool:
        rest = iter(jobs)
        pending = deque(pool.submit(fn, job) for job in islice(rest, threads + 1))
        try:
            while pending:
                result = pending.popleft().result()
                pending.extend(pool.submit(fn, job) for job in islice(rest, 1))
                yield result
        finally:
            for future in pending:
                future.cancel()


def serial_blas():
    """A context in which numpy's BLAS and LAPACK run on one thread (threadpoolctl; process-wide while
    it lasts). Every product here is small (K of a few thousand at most): threads add nothing on idle
    cores (bert_encoder's smooth-quant: 0.14 s on one or two) and cost most on busy ones (a 576 x 576
    Cholesky: 5 ms on one thread, 0.8 s on two while other processes hold the cores; smooth-quant
    0.14 -> 1.5 s); the results are the same."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(1, user_api="blas")
