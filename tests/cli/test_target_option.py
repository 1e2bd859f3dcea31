"""qpasses run --target / --require-target and the summary line."""
from __future__ import annotations

import subprocess
import sys

import pytest

from qpasses.cli.examples import write_example


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return write_example(tmp_path_factory.mktemp("ex"))


def _run(example, out, *extra):
    model, calib, _ = example
    return subprocess.run([sys.executable, "-m", "qpasses", "run", str(model), "-o", str(out), "--calib", str(calib),
                           *extra], capture_output=True, text=True)


def test_a_met_target_prints_the_summary(example, tmp_path):
    run = _run(example, tmp_path / "q.onnx", "--target", "snr=20")
    assert run.returncode == 0, run.stderr
    assert "qpasses: 8-bit: 100 % of weighted ops (3 of 3)" in run.stderr
    assert "kept float: 2 tensors (res, relu2)" in run.stderr   # the residual Add stays float by default


def test_an_unreachable_target_is_exit_3_with_nothing_written(example, tmp_path):
    run = _run(example, tmp_path / "q.onnx", "--target", "top1=1.01", "--require-target")
    assert run.returncode == 3, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("qpasses: error: search-precision reached") and "--require-target" in lines[-1]
    assert not (tmp_path / "q.onnx").exists()


def test_without_require_target_it_warns_and_writes(example, tmp_path):
    run = _run(example, tmp_path / "q.onnx", "--target", "top1=1.01")
    assert run.returncode == 0 and "qpasses: warning: search-precision reached" in run.stderr
    assert (tmp_path / "q.onnx").exists()


@pytest.mark.parametrize("spec", ["snr", "loss=3", "snr=abc", "snr=nan"])
def test_a_bad_target_is_one_line_exit_2(example, tmp_path, spec):
    run = _run(example, tmp_path / "q.onnx", "--target", spec)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and "--target" in run.stderr
    assert not (tmp_path / "q.onnx").exists()
