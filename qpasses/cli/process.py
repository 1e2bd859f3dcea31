"""Process-level concerns of the command line: signals, onnxruntime's own log, one-line errors.

- SIGINT, SIGTERM and SIGHUP all raise :class:`Interrupted` (a KeyboardInterrupt), so the command
  unwinds, removes what it staged and exits 128 + the signal number with one line. Inside
  ``deferred_signals`` (a commit, or its undoing) a signal is only recorded: a commit is never cut in half.
- onnxruntime logs errors itself, in C++, on file descriptor 2 (a coloured line before ours):
  ``native_stderr_silenced`` points that descriptor at /dev/null while the command runs and keeps
  Python's ``sys.stderr`` on the real stderr.
- ``error_line``: every failure is one line, control characters escaped.
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import threading

from .paths import escape

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Interrupted(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM, SIGHUP) asked the command to stop."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


_state = {"defer": 0, "pending": None}


def _handler(signum, frame):
    if _state["defer"]:
        _state["pending"] = signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_interrupt():
    """SIGINT, SIGTERM and SIGHUP raise Interrupted while the block runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for s in SIGNALS:
        with contextlib.suppress(OSError, ValueError):
            previous[s] = signal.signal(s, _handler)
    try:
        yield
    finally:
        for s, old in previous.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(s, old)


@contextlib.contextmanager
def deferred_signals():
    """Signals arriving in the block are recorded, not raised (the block finishes what it does)."""
    _state["defer"] += 1
    try:
        yield
    finally:
        _state["defer"] -= 1
        if not _state["defer"]:
            _state["pending"] = None


@contextlib.contextmanager
def native_stderr_silenced(enabled: bool = True):
    """File descriptor 2 goes to /dev/null in the block; ``sys.stderr`` keeps the real stderr."""
    if not enabled:
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    original = sys.stderr
    try:
        ours = original.fileno() == 2
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        ours = False   # already captured (pytest's capsys): leave it as it is
    if ours:
        sys.stderr = io.TextIOWrapper(io.FileIO(saved, "w", closefd=False), line_buffering=True,
                                      encoding=getattr(original, "encoding", None) or "utf-8",
                                      errors="backslashreplace")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        sys.stderr = original


def guarded(func, args, discard_open, *, debug: bool = False) -> int:
    """Run a command ``func(args)``: SIGTERM/SIGHUP interrupt it like SIGINT, onnxruntime's own log
    and Python's warnings are silenced (unless ``debug``: --traceback), and whatever it staged and
    did not commit is removed by ``discard_open()``, which returns what could not be removed."""
    import warnings

    with signals_interrupt(), native_stderr_silenced(not debug), warnings.catch_warnings():
        if not debug:   # numpy's and onnx's warnings would add lines to a one-line error
            warnings.simplefilter("ignore")
        try:
            return func(args) or 0
        except BaseException as exc:
            problem = discard_open()
            if problem and isinstance(exc, Exception) and len(exc.args) <= 1:
                exc.args = (f"{exc}; {problem}",)
            raise
        finally:
            discard_open()


def error_line(exc: BaseException, *, internal: bool, hint: bool = True) -> str:
    """The one stderr line for a failure: 'qpasses: error: ...' (exit 2) or 'qpasses: internal
    error: ...' with the --traceback hint on the same line (exit 1)."""
    text = str(exc).strip() or type(exc).__name__
    if not internal:
        return f"qpasses: error: {escape(text)}"
    from ..errors import PassFailure

    if not isinstance(exc, PassFailure) and type(exc).__name__ != "OutputRefused":
        text = f"{type(exc).__name__}: {text}"
    tail = " (run with --traceback for details)" if hint else ""
    return f"qpasses: internal error: {escape(text)}{tail}"


def interrupted_line(exc: KeyboardInterrupt) -> tuple[str, int]:
    """The line and exit code for an interruption (130 for SIGINT, 143 SIGTERM, 129 SIGHUP)."""
    signum = getattr(exc, "signum", signal.SIGINT)
    name = signal.Signals(signum).name
    return f"qpasses: interrupted ({name}); nothing was written", 128 + int(signum)
