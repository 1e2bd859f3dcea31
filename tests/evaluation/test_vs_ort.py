"""run --vs-onnxruntime: the output's latency and size against onnxruntime's own QDQ model."""
import json
from html import escape

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qpasses.cli import main
from qpasses.cli.examples import write_example
from qpasses.evaluation.vs_ort import compare, interleaved_latencies, line, ort_qdq_model


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return write_example(tmp_path_factory.mktemp("example"))


def test_run_prints_and_reports_the_ratios(example, tmp_path, capsys):
    model, calib, _ = example
    out, report, page = tmp_path / "q.onnx", tmp_path / "r.json", tmp_path / "r.html"
    assert main(["run", str(model), "-o", str(out), "--calib", str(calib), "--vs-onnxruntime",
                 "--report", str(report), "--html", str(page)]) == 0
    err = capsys.readouterr().err
    result = json.loads(report.read_text())["vs_onnxruntime"]
    assert result["onnxruntime"] == "quantize_static QDQ U8S8 per-channel MinMax" and result["runs"] == 20
    assert result["latency_ratio"] == pytest.approx(result["latency_ms"] / result["onnxruntime_latency_ms"], rel=0.01)
    assert result["size_mb"] == pytest.approx(out.stat().st_size / 1e6, rel=0.01)
    assert result["size_ratio"] == pytest.approx(result["size_mb"] / result["onnxruntime_size_mb"], rel=0.01)
    assert line(result) in err and "WARNING:root" not in err   # onnxruntime's advice stays quiet
    assert escape(line(result)) in page.read_text()


def test_the_report_says_where_speed_was_not_measured(example, tmp_path):
    model, calib, _ = example
    out, page = tmp_path / "q.onnx", tmp_path / "r.html"
    assert main(["run", str(model), "-o", str(out), "--calib", str(calib), "--html", str(page), "--quiet"]) == 0
    assert "not measured here" in page.read_text() and "--vs-onnxruntime" in page.read_text()


def test_without_calibration_data_it_is_refused(example, tmp_path, capsys):
    model, _, _ = example
    out = tmp_path / "q.onnx"
    assert main(["run", str(model), "-o", str(out), "--vs-onnxruntime"]) == 2
    assert "--vs-onnxruntime" in capsys.readouterr().err and not out.exists()


def test_per_tensor_where_the_per_channel_model_does_not_load(tmp_path):
    """Below opset 13 DequantizeLinear has no axis: onnxruntime's per-channel output does not load."""
    rng = np.random.default_rng(0)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "c",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
                          [numpy_helper.from_array(rng.normal(0, 1, (4, 3, 3, 3)).astype(np.float32), "w")])
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)], ir_version=7), src)
    data = [{"x": rng.normal(0, 1, (1, 3, 8, 8)).astype(np.float32)} for _ in range(4)]
    path, per_channel = ort_qdq_model(src, data, tmp_path)
    assert per_channel is False and path.name == "onnxruntime_per_tensor.onnx"
    result = compare(src, src, data, runs=3)   # the float model against onnxruntime's int8 one
    assert "per-tensor" in result["onnxruntime"] and result["size_ratio"] > 0 and result["latency_ms"] > 0


def test_latencies_are_one_per_model(example):
    model, _, _ = example
    first = onnx.load(str(model)).graph.input[0]
    feed = {first.name: np.zeros([d.dim_value or 1 for d in first.type.tensor_type.shape.dim], np.float32)}
    times = interleaved_latencies([model, model], feed, runs=3)
    assert len(times) == 2 and all(t > 0 for t in times)
