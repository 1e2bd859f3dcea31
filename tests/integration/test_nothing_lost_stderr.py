"""Nothing lost (issue 14), class 6: stderr and the report.

- every failure is one stderr line, internal errors (exit 1) included: the --traceback hint is on
  the same line; onnxruntime's own (coloured, C++) log line never shows; control characters and
  bytes that are not UTF-8 in paths and names are escaped; a FIFO given as the model does not hang;
- the --report JSON is strict: NaN is written as null, infinities as the strings "inf" / "-inf".
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest

from tests.kits.nothing_lost_kit import (Workspace, assert_refused, convs, make_fifo, mlp, run_cli, snapshot, strict_loads,
                              write_model, write_npz)
from qpasses.testing import parse


def _raise_in(monkeypatch, exc, pass_cls=None):
    from qpasses.passes.insert_qdq import InsertQDQ

    def broken(self, model, ctx):
        raise exc

    monkeypatch.setattr(pass_cls or InsertQDQ, "run", broken)


INTERNAL = [
    ("plain", ValueError("boom"), "pass 'insert-qdq' failed: ValueError: boom"),
    ("multi-line message", RuntimeError("first\nsecond\nthird"), "RuntimeError: first\\nsecond\\nthird"),
    ("empty message", KeyError(), "pass 'insert-qdq' failed: KeyError"),
    ("control characters", ValueError("bell\x07 escape\x1b[31m red"), "bell\\x07 escape\\x1b[31m red"),
    ("carriage return", ValueError("over\rwritten"), "over\\rwritten"),
]


@pytest.mark.parametrize("exc, fragment", [pytest.param(e, f, id=i) for i, e, f in INTERNAL])
def test_an_internal_error_is_one_line_with_the_hint_on_it(exc, fragment, tmp_path, capsys, monkeypatch):
    ws = Workspace(tmp_path)
    _raise_in(monkeypatch, exc)
    line = assert_refused(capsys, tmp_path, ws.run("--report", ws.report), fragment, 1)
    assert line.endswith("(run with --traceback for details)")


def test_traceback_shows_the_stack_then_the_line(tmp_path, capsys, monkeypatch):
    ws = Workspace(tmp_path)
    _raise_in(monkeypatch, ValueError("boom"))
    code, lines, _ = run_cli(capsys, ws.run("--traceback"))
    assert code == 1 and lines[0].startswith("Traceback") and lines[-1].startswith("qpasses: internal error:")
    assert "--traceback for details" not in lines[-1]


def test_warnings_add_no_line(tmp_path, capsys, monkeypatch):
    from qpasses.passes.calibrate import Calibrate

    def noisy(self, model, ctx):
        warnings.warn("overflow encountered", RuntimeWarning)
        raise ValueError("after a warning")

    monkeypatch.setattr(Calibrate, "run", noisy)
    ws = Workspace(tmp_path)
    assert_refused(capsys, tmp_path, ws.run(), "after a warning", 1)


def test_notices_of_a_failed_run_add_no_line(tmp_path, capsys, monkeypatch):
    """An opset-9 model is upgraded (a notice) and then a pass fails: only the error line."""
    ws = Workspace(tmp_path, mlp(opset=9))
    _raise_in(monkeypatch, ValueError("boom"))
    assert_refused(capsys, tmp_path, ws.run(), "ValueError: boom", 1)


def test_notices_of_a_good_run_are_printed(tmp_path, capsys):
    ws = Workspace(tmp_path, mlp(opset=9))
    code, lines, _ = run_cli(capsys, ws.run())
    assert code == 0 and any("opset" in line for line in lines) and lines[-1] == f"qpasses: wrote {ws.out}"


# -- onnxruntime's own log -------------------------------------------------------------------------------
def _channel_mismatch(ws):
    """Input declared [1,5,8,8] against a 4x3x3x3 weight: onnxruntime fails at run time and logs it."""
    w = ",".join(["0.1"] * 108)
    model = parse(f"m (float[1,5,8,8] x) => (float[1,4,8,8] y) <float[4,3,3,3] w = {{{w}}}> "
                  "{ y = Conv <pads = [1,1,1,1]> (x, w) }")
    write_model(ws.model, model)
    write_npz(ws.calib, {"x": np.ones((2, 1, 5, 8, 8), np.float32)})


def test_onnxruntime_logs_nothing_in_a_process(tmp_path):
    ws = Workspace(tmp_path)
    _channel_mismatch(ws)
    before = snapshot(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "qpasses", *ws.run()], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("qpasses: error:") and "onnxruntime cannot run the model" in lines[0]
    assert "\x1b" not in proc.stderr
    assert snapshot(tmp_path) == before


def test_onnxruntime_logs_nothing_in_process(tmp_path, capfd):
    from qpasses.cli import main

    ws = Workspace(tmp_path)
    _channel_mismatch(ws)
    assert main(ws.run()) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qpasses: error:"), err


def test_a_fifo_model_does_not_hang(tmp_path):
    ws = Workspace(tmp_path)
    fifo = make_fifo(tmp_path / "m.onnx")
    proc = subprocess.run([sys.executable, "-m", "qpasses", *ws.run(model=fifo)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"qpasses: error: {fifo}: the input model is a FIFO, not a regular file (refused)"]


# -- control characters and bytes in paths and names --------------------------------------------------------
def _model_named(ws, name):
    path = ws.root / name
    path.write_bytes(ws.model.read_bytes())
    return path


NAMES = [
    ("newline in a missing model's path", lambda ws: ws.run(model=ws.root / "a\nb.onnx"), "a\\nb.onnx: no such file"),
    ("escape sequence in the output path", lambda ws: ws.run(out=ws.root / "nope\x1b[2J" / "q.onnx"),
     "nope\\x1b[2J"),
    ("tab in a config path", lambda ws: ws.run("--config", ws.root / "c\tx.json"), "c\\tx.json"),
    ("newline in a config key", lambda ws: _config(ws, {"activaton\n_type": "uint8"}), "activaton\\n_type"),
    ("escape in a tensor override", lambda ws: _config(ws, {"tensor_overrides": {"gh\x1bost": [{"quant_type": "uint16"}]}}),
     "gh\\x1bost"),
    ("newline in a node name", lambda ws: _node_named(ws, "mat\nmul"), "mat\\nmul"),
    ("bytes that are not UTF-8 in a path", lambda ws: ws.run(model=os.fsdecode(bytes(ws.root) + b"/m\xff.onnx")),
     "m\\xff.onnx: no such file"),
    ("DEL and C1 controls", lambda ws: ws.run(model=ws.root / "a\x7fb\x9bc.onnx"), "a\\x7fb\\x9bc.onnx"),
]


def _config(ws, data):
    ws.config.write_text(json.dumps(data))
    return ws.run("--config", ws.config)


def _node_named(ws, name):
    m = mlp()
    m.graph.node[0].name = name
    m.graph.node[0].op_type = "MatMulx"
    write_model(ws.model, m)
    return ws.run()


@pytest.mark.parametrize("build, fragment", [pytest.param(b, f, id=i) for i, b, f in NAMES])
def test_control_characters_are_escaped(build, fragment, tmp_path, capsys):
    ws = Workspace(tmp_path)
    line = assert_refused(capsys, tmp_path, build(ws), fragment)
    assert line.isprintable()


def test_a_model_path_that_is_not_utf8_runs(tmp_path, capsys):
    ws = Workspace(tmp_path)
    src = os.fsdecode(bytes(tmp_path) + b"/m\xff.onnx")
    out = os.fsdecode(bytes(tmp_path) + b"/out/q\xfe.onnx")
    os.rename(ws.model, src)
    code, lines, _ = run_cli(capsys, ws.run("--report", ws.report, model=src, out=out))
    assert code == 0, lines
    assert os.path.exists(out) and all(line.isprintable() for line in lines)
    report = strict_loads(ws.report.read_text())
    assert report["accuracy"]["snr_db"] > 10


# -- strict JSON ---------------------------------------------------------------------------------------------
def test_an_identical_output_reports_inf_as_a_string(tmp_path, capsys):
    ws = Workspace(tmp_path, parse("m (float[1,4] x) => (float[1,4] y) { y = Neg (x) }"))
    code, lines, _ = run_cli(capsys, ws.run("--report", ws.report, "--passes",
                                            "annotate-types,calibrate,compute-qparams,insert-qdq"))
    assert code == 0, lines
    report = strict_loads(ws.report.read_text())
    assert report["accuracy"]["snr_db"] == "inf" and report["accuracy"]["outputs"]["y"]["snr_db"] == "inf"


@pytest.mark.parametrize("value, written", [(math.nan, None), (math.inf, "inf"), (-math.inf, "-inf"),
                                            (np.float32("nan"), None), (np.float64("-inf"), "-inf")])
def test_non_finite_numbers_in_the_report(value, written, tmp_path, capsys, monkeypatch):
    import qpasses.evaluation.evaluate

    def fake(*a, **k):
        return {"samples": 1, "snr_db": value, "outputs": {"y": {"snr_db": value, "max_abs_error": value}},
                "objective": None}

    monkeypatch.setattr(qpasses.evaluation.evaluate, "compare", fake)
    ws = Workspace(tmp_path)
    code, lines, _ = run_cli(capsys, ws.run("--report", ws.report))
    assert code == 0, lines
    text = ws.report.read_text()
    assert "NaN" not in text and "Infinity" not in text
    report = strict_loads(text)
    assert report["accuracy"]["snr_db"] == written and report["accuracy"]["outputs"]["y"]["max_abs_error"] == written


def test_a_normal_report_is_strict_json(tmp_path, capsys):
    ws = Workspace(tmp_path, convs())
    code, lines, _ = run_cli(capsys, ws.run("--report", ws.report, "--eval", ws.eval))
    assert code == 0, lines
    report = strict_loads(ws.report.read_text())
    assert report["output"] == str(ws.out) and "qdq-inserted" in report["facts"]
    assert isinstance(report["accuracy"]["snr_db"], float)
    onnx.checker.check_model(onnx.load(ws.out))
