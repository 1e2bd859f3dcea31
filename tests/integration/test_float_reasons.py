"""Every float tensor a pass leaves unquantized has its reason in the saved model, the report and
`qpasses explain`."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx

from qpasses.api import run_pipeline
from qpasses.cli.explain import explain_lines
from qpasses.ir.decisions import float_reasons
from qpasses.ir.model import from_proto
from qpasses.testing import parse

GRAPH = """
g (float[1,2,4,4] x) => (float[1,2,4,4] y) <float[2,2,1,1] w = {0.5, -0.25, 0.125, 1.0}, float[2] b = {0.1, -0.2},
                                             float[2,2,1,1] v = {0.3, 0.2, -0.1, 0.7}>
{
  c = Conv(x, w, b)
  s = Sin(c)
  d = Conv(s, v)
  y = Relu(d)
}
"""


def _feeds(n=4):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(1, 2, 4, 4)).astype(np.float32)} for _ in range(n)]


def test_reasons_are_saved_and_explained():
    model, _ = run_pipeline(from_proto(parse(GRAPH)), config={"nodes_to_exclude": ["Conv_2"]},
                            calibration_data=_feeds())
    reasons = float_reasons(from_proto(model.to_proto()))   # what the saved model says
    assert "s" in reasons and "d" in reasons
    assert "Conv 'Conv_2' is in the config's nodes_to_exclude" in reasons["d"]["reason"]
    assert reasons["d"]["pass"] == "annotate-types"
    lines = explain_lines(model, "s")
    assert lines[0] == "s: left float" and "annotate-types" in lines[1]
    assert any(line.startswith("y: left float") for line in explain_lines(model))


def test_an_op_without_a_rule_is_named():
    graph = GRAPH.replace("d = Conv(s, v)\n  y = Relu(d)", "y = Sin(s)").replace("float[1,2,4,4] y", "float[1,2,4,4] y")
    model, _ = run_pipeline(from_proto(parse(graph)), calibration_data=_feeds())
    reasons = float_reasons(model)
    assert reasons["y"]["reason"] == "no node around it is quantized: qpasses has no quantization rule for Sin"
    assert "c" in model.quant   # the Conv's output is quantized


def test_cli_report_lists_every_float_tensor(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(parse(GRAPH), src)
    np.savez(tmp_path / "calib.npz", x=np.stack([f["x"][0] for f in _feeds(8)]))
    (tmp_path / "cfg.json").write_text(json.dumps({"op_types_to_quantize": ["Conv"]}))
    run = subprocess.run([sys.executable, "-m", "qpasses", "run", str(src), "-o", str(tmp_path / "q.onnx"),
                          "--calib", str(tmp_path / "calib.npz"), "--config", str(tmp_path / "cfg.json"),
                          "--report", str(tmp_path / "r.json"), "--quiet"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    rows = {row["tensor"]: row for row in report["unquantized"]}
    assert "y" in rows and "not selected by the config" in rows["y"]["reason"]
    explained = subprocess.run([sys.executable, "-m", "qpasses", "explain", str(tmp_path / "q.onnx"),
                                "--tensor", "y"], capture_output=True, text=True)
    assert explained.returncode == 0 and "left float" in explained.stdout
