"""What a user reads first is the truth: the kept-float list names compute tensors, --time-passes
prints each nested pass once, check predicts what run quantizes, why-lines read in the direction
of their decision, the Python API reads a one-shot generator once and says what it did."""
from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from qpasses.cli import main


def detector() -> onnx.ModelProto:
    """x -> MatMul -> Relu -> {boxes: MatMul * 320, scores: Sigmoid(MatMul + b)} -> Concat."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in (("w1", (16, 32)), ("wb", (32, 4)), ("ws", (32, 20)))]
    inits += [numpy_helper.from_array(np.array(320, np.float32), "k"),
              numpy_helper.from_array(np.full(20, -4, np.float32), "bs")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"), helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "wb"], ["b0"], name="box"),
             helper.make_node("Mul", ["b0", "k"], ["boxes"], name="boxmul"),
             helper.make_node("MatMul", ["r", "ws"], ["s0"], name="cls"),
             helper.make_node("Add", ["s0", "bs"], ["s1"], name="clsb"),
             helper.make_node("Sigmoid", ["s1"], ["scores"], name="sig"),
             helper.make_node("Concat", ["boxes", "scores"], ["output0"], name="cat", axis=2)]
    graph = helper.make_graph(nodes, "det", [helper.make_tensor_value_info("x", 1, [1, 64, 16])],
                              [helper.make_tensor_value_info("output0", 1, [1, 64, 24])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.fixture(scope="module")
def det_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("det")
    onnx.save(detector(), folder / "det.onnx")
    np.savez(folder / "calib.npz", x=np.random.default_rng(1).standard_normal((8, 1, 64, 16)).astype(np.float32))
    return folder


def _run(capsys, *args):
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def test_kept_float_names_compute_tensors_not_constants(det_files, tmp_path, capsys):
    report, page = tmp_path / "r.json", tmp_path / "r.html"
    code, err = _run(capsys, "run", det_files / "det.onnx", "-o", tmp_path / "q.onnx", "--calib",
                     det_files / "calib.npz", "--report", report, "--html", page)
    assert code == 0, err
    recorded = {row["tensor"] for row in json.loads(report.read_text())["unquantized"]}
    assert "k" in recorded   # the Mul's constant stays float (the JSON report keeps every reason)
    line = next(x for x in err.splitlines() if "kept float:" in x)
    count, names = re.search(r"kept float: (\d+) tensors \((.*)\)", line).groups()
    assert int(count) == len(recorded) - 1
    assert names == "b0, boxes, s0, s1, scores, ..."   # graph order, no constant
    text = page.read_text()
    assert "6 tensors left float, and why (and 1 constant: weights, biases, shapes, parameters)" in text


def test_time_passes_prints_each_nested_pass_once(det_files, tmp_path, capsys):
    code, err = _run(capsys, "run", det_files / "det.onnx", "-o", tmp_path / "q.onnx", "--calib",
                     det_files / "calib.npz", "--time-passes")
    assert code == 0, err
    table = err[err.index("  seconds"):].splitlines()[1:-2]
    rows = [re.match(r"\s*([0-9.]+)\s+[0-9.]+\s+(\s*(?:└ )?)(\S+)( x\d+)?", line).groups() for line in table]
    parents = []
    for seconds, indent, name, runs in rows:
        if not indent:
            parents.append([name, float(seconds), []])
        else:
            parents[-1][2].append((name, runs, float(seconds)))
    nested = {name: children for name, _, children in parents if children}
    assert nested["select-by-snr"], table   # two variants scored: each nested pass ran twice
    for parent, children in nested.items():
        names = [c[0] for c in children]
        assert len(names) == len(set(names)), f"{parent}: {names}"   # one row each
    assert [c[1] for c in nested["select-by-snr"]] == [" x2"] * len(nested["select-by-snr"])
    assert err.strip().splitlines()[-1].startswith("qpasses: wrote")


def _run_quantized_weighted_ops(path) -> dict[str, int]:
    """Per op type, the weighted ops of a QDQ model whose data input and weight both come from a DequantizeLinear."""
    from collections import Counter

    graph = onnx.load(path).graph
    producer = {o: n.op_type for n in graph.node for o in n.output}
    return dict(Counter(n.op_type for n in graph.node if n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul")
                        and all(producer.get(t) == "DequantizeLinear" for t in n.input[:2])))


@pytest.mark.parametrize("which", ["encoder", "detector"])
def test_check_counts_the_weighted_ops_run_quantizes(det_files, tmp_path, capsys, which):
    """MiniLM-class MatMuls whose output is read as float (a bias Add follows) are quantized: check
    says so, as run does (the accuracy search off: a target any model meets)."""
    from tests.core.test_claims import VOCAB, encoder

    from qpasses.cli.preflight import check

    if which == "encoder":
        path, calib = tmp_path / "enc.onnx", tmp_path / "calib.npz"
        onnx.save(encoder(), path)
        np.savez(calib, input_ids=np.random.default_rng(1).integers(0, VOCAB, (8, 1, 16)).astype(np.int64))
    else:
        path, calib = det_files / "det.onnx", det_files / "calib.npz"
    report = check(path)
    predicted = {op: len(entries) for op, entries in report.quantized.items()
                 if op in ("Conv", "ConvTranspose", "Gemm", "MatMul")}
    code, err = _run(capsys, "run", path, "-o", tmp_path / "q.onnx", "--calib", calib, "--target", "snr=-100")
    assert code == 0, err
    assert predicted == _run_quantized_weighted_ops(tmp_path / "q.onnx") != {}
    assert not any("…" in line for line in report.lines)
    if which == "encoder":
        assert predicted == {"MatMul": 15}
        line = next(x for x in report.lines if x.startswith("  MatMul x4:"))   # the attention MatMuls
        assert "multiplies two computed tensors" in line


def test_check_reasons_name_the_tensor_not_an_ellipsis(tmp_path):
    from qpasses.cli.preflight import check
    from qpasses.testing import parse

    text = """
    g (float[1, 3, 8, 8] x) => (float[1, 4, 8, 8] y, float[1, 3, 16, 16] z) <float[4, 3, 1, 1] w = {1,2,3,4,5,6,7,8,9,10,11,12},
                                                                           float[4] s = {1, 1, 2, 2}> {
      y = Conv (x, w)
      a = Add (x, x)
      r = Resize <mode="nearest"> (a, "", s)
      z = Sigmoid (r)
    }"""
    onnx.save(parse(text), tmp_path / "m.onnx")
    lines = check(tmp_path / "m.onnx").lines
    assert "  Resize x1: Resize is quantized only when its input is, and 'a' stays float" in lines
    assert not any("…" in line for line in lines)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    from qpasses.cli.examples import write_example

    return write_example(tmp_path_factory.mktemp("example"))


def _feeds(calib):
    return [{"input": x} for x in np.load(calib)["input"]]


def test_a_generator_is_read_once_into_the_samples_every_pass_needs(example):
    import qpasses

    model, calib, _ = example
    from_list = qpasses.quantize(model, _feeds(calib))
    from_generator = qpasses.quantize(model, (f for f in _feeds(calib)))
    # the same model: the search's confirmation and round-weights read the samples again
    assert from_generator.to_proto().SerializeToString() == from_list.to_proto().SerializeToString()
    assert from_generator.summary == "8-bit: 100 % of weighted ops (3 of 3); kept float: 2 tensors (res, relu2)"


def test_a_generator_too_big_to_keep_is_refused_with_the_reason(example, monkeypatch):
    import qpasses
    from qpasses import api
    from qpasses.errors import CalibrationDataError

    monkeypatch.setattr(api, "ONE_SHOT_BYTES", 10_000)
    model, calib, _ = example
    with pytest.raises(CalibrationDataError, match="a one-shot source .* is read into memory because several "
                                                   "passes read the calibration data again"):
        qpasses.quantize(model, (f for f in _feeds(calib)))


def test_quantize_static_takes_onnxruntimes_call(example, tmp_path):
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType

    import qpasses
    from qpasses.errors import ConfigError

    class Reader(CalibrationDataReader):   # get_next() until None, no rewind()
        def __init__(self, feeds):
            self.feeds = iter(feeds)

        def get_next(self):
            return next(self.feeds, None)

    model, calib, _ = example
    out = tmp_path / "q.onnx"
    q = qpasses.quantize_static(str(model), str(out), Reader(_feeds(calib)), quant_format=QuantFormat.QDQ,
                                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=False,
                                calibrate_method=CalibrationMethod.MinMax, op_types_to_quantize=["Conv", "Gemm"],
                                nodes_to_exclude=["fc"], extra_options={"WeightSymmetric": True})
    saved = onnx.load(out)
    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    inits = {t.name: t for t in saved.graph.initializer}
    weight_scales = [inits[n.input[1]] for n in saved.graph.node if n.op_type == "DequantizeLinear"
                     and n.input[0] in inits and inits[n.input[0]].data_type == onnx.TensorProto.INT8]
    assert len(weight_scales) == 2 and all(not s.dims or s.dims == [1] for s in weight_scales)   # per tensor
    assert q.decisions["calibration"]["method"] == "minmax"
    assert q.summary.startswith("8-bit: 67 % of weighted ops (2 of 3)")   # fc excluded
    with pytest.raises(ConfigError, match="CPUExecutionProvider only"):
        qpasses.quantize_static(str(model), str(tmp_path / "x.onnx"), Reader(_feeds(calib)),
                                calibration_providers=["CUDAExecutionProvider"])
    assert not (tmp_path / "x.onnx").exists()
