"""Progress of long steps: a bar on a terminal, rate-limited lines otherwise, nothing when quiet."""
import io
import os
import subprocess
import sys

import pytest

from qpasses.core.progress import Progress, progress
from tests.kits import ROOT


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Tty(io.StringIO):
    def isatty(self):
        return True


def _auto(monkeypatch, stream, clock=None, **kw):
    monkeypatch.delenv("QPASSES_NO_PROGRESS", raising=False)
    monkeypatch.setattr(sys, "stderr", stream)
    return Progress("calibrate", 64, clock=clock or Clock(), **kw)


def test_lines_are_rate_limited_when_stderr_is_not_a_terminal(monkeypatch):
    stream, clock = io.StringIO(), Clock()
    bar = _auto(monkeypatch, stream, clock, interval=10)
    assert bar.mode == "lines"
    for done in range(1, 65):
        clock.now = done * 0.5          # 32 s in all: lines at 10, 20 and 30 s, then the last one
        bar.update(done)
    bar.close()
    assert stream.getvalue().splitlines() == [
        "calibrate: 20/64 samples, 10 s", "calibrate: 40/64 samples, 20 s", "calibrate: 60/64 samples, 30 s",
        "calibrate: 64/64 samples, 32 s (done)"]


def test_a_short_step_prints_nothing_off_a_terminal(monkeypatch):
    stream, clock = io.StringIO(), Clock()
    with _auto(monkeypatch, stream, clock, interval=10) as bar:
        for done in range(1, 65):
            clock.now = done * 0.1
            bar.update(done)
    assert stream.getvalue() == ""


def test_a_bar_on_a_terminal(monkeypatch):
    stream = Tty()
    with _auto(monkeypatch, stream) as bar:
        bar.update(32)
    text = stream.getvalue()
    assert bar.mode is None   # closed
    assert text.startswith("\rcalibrate [" + "#" * 15 + "." * 15 + "] 32/64") and text.endswith("samples/s\n")


def test_quiet_prints_nothing(monkeypatch):
    stream = Tty()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setenv("QPASSES_NO_PROGRESS", "1")
    with Progress("calibrate", 4) as bar:
        bar.update(4)
    assert stream.getvalue() == "" and not bar.enabled


def test_nested_pipelines_show_no_progress(monkeypatch):
    class Ctx:
        depth = 1

    stream = Tty()
    monkeypatch.delenv("QPASSES_NO_PROGRESS", raising=False)
    monkeypatch.setattr(sys, "stderr", stream)
    with progress(Ctx(), "correct-bias", 4) as bar:
        bar.update(4)
    assert stream.getvalue() == ""


def test_a_stderr_that_went_away_is_not_an_error(monkeypatch):
    stream = io.StringIO()
    stream.close()
    bar = _auto(monkeypatch, stream, interval=0)
    bar.update(1)
    bar.close()
    assert not bar.enabled


@pytest.mark.parametrize("quiet", [False, True])
def test_every_long_step_reports_in_a_log(quiet, tmp_path):
    """stderr to a file: calibrate, select-by-snr, search-precision and correct-bias each write
    lines (interval 0 here); --quiet: nothing at all."""
    from qpasses.cli.examples import write_example

    model, calib, _ = write_example(tmp_path)
    passes = ("fold-constants,fold-batchnorm,cleanup,annotate-types,propagate-mixed-precision,calibrate,"
              "select-by-snr,search-precision,compute-qparams,correct-bias{activation_bits=8},fix-bias-scales,"
              "insert-qdq,insert-converts,cleanup")
    env = {k: v for k, v in os.environ.items() if k != "QPASSES_NO_PROGRESS"}
    env.update(PYTHONPATH=str(ROOT), QPASSES_PROGRESS_INTERVAL="0")
    cmd = [sys.executable, "-m", "qpasses", "run", str(model), "-o", str(tmp_path / "q.onnx"),
           "--calib", str(calib), "--passes", passes] + (["--quiet"] if quiet else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if quiet:
        assert proc.stderr == ""
        return
    lines = proc.stderr.splitlines()
    for step, unit in (("calibrate", "samples"), ("select-by-snr", "variants"),
                       ("search-precision", "evaluations"), ("correct-bias", "samples")):
        mine = [line for line in lines if line.startswith(f"{step}: ")]
        assert mine and mine[-1].endswith(" s (done)") and f" {unit}, " in mine[-1], (step, lines)
    assert "\r" not in proc.stderr
