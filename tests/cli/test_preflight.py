"""qpasses check: the preflight report and its exit code (0: can be quantized, 2: cannot)."""
import json

import numpy as np
import onnx
import pytest
from onnx import helper

from qpasses.cli import main
from qpasses.cli.examples import write_example
from qpasses.cli.preflight import check
from qpasses.testing import parse

CONV = """
g (float[N, 3, 8, 8] x) => (float[N, 4, 8, 8] y) <float[4, 3, 1, 1] w = {1,2,3,4,5,6,7,8,9,10,11,12}, float[4] b = {1,2,3,4}> {
  c = Conv (x, w, b)
  r = Relu (c)
  y = Sigmoid (r)
}"""


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return write_example(tmp_path_factory.mktemp("example"))


def _save(tmp_path, proto, name="m.onnx"):
    path = tmp_path / name
    onnx.save(proto, path)
    return path


def _check(capsys, *args):
    code = main(["check", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_example_can_be_quantized(example, capsys):
    code, out, err = _check(capsys, example[0])
    assert code == 0 and not err
    assert "Conv x2: uint8 2" in out and "Gemm x1: uint8 1" in out
    # the residual Add stays float by default, with annotate-types' reason
    assert "Add x1: Add stays float by default" in out
    assert ("int16 pair sums: 3 of 3 uint8 x int8 layers can saturate on x86-64 without VNNI, "
            "protect-pair-sums protects those that saturate measurably on the calibration data (data=false: all): "
            "Conv 'conv1'") in out
    assert out.rstrip().endswith("verdict: can be quantized")


def test_the_report_agrees_with_what_run_quantizes(example, tmp_path, capsys):
    """Every tensor preflight counts as quantized is in the table of the model run writes."""
    from qpasses.ir.model import load

    report = check(example[0])
    out = tmp_path / "q.onnx"
    assert main(["run", str(example[0]), "-o", str(out), "--calib", str(example[1]), "--quiet"]) == 0
    table = load(out).quant
    entries = [name for names in report.quantized.values() for name in names]
    assert len(entries) == 7 and set(entries) <= set(table)
    assert sorted(report.quantized) == ["Conv", "Flatten", "Gemm", "GlobalAveragePool", "MaxPool", "Relu"]


def test_dynamic_dims_opset_raise_and_inputs(tmp_path, capsys):
    code, out, _ = _check(capsys, _save(tmp_path, parse(CONV, opset=12)))
    assert code == 0
    assert "input: x float32 ['N', 3, 8, 8] (dynamic" in out
    assert "opset: model raised from opset 12 to 13 for per-channel weights\n" in out
    assert "Sigmoid x1: Sigmoid stays float by default" in out


def test_an_old_opset_is_upgraded_as_run_does(tmp_path, capsys):
    text = "g (float[1, 4] x) => (float[1, 2] y) <float[4, 2] w = {1,2,3,4,5,6,7,8}> { y = MatMul (x, w) }"
    code, out, _ = _check(capsys, _save(tmp_path, parse(text, opset=9)))
    assert code == 0
    assert "model upgraded from opset 9 to 11" in out and "MatMul x1: uint8 1" in out


def test_nothing_selected_is_exit_2(tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"op_types_to_quantize": ["Softmax"]}))
    code, out, err = _check(capsys, _save(tmp_path, parse(CONV)), "--config", config)
    assert code == 2 and "verdict: cannot be quantized" in out
    assert err.count("\n") == 1 and "cannot be quantized: no op would be quantized" in err


def test_four_bit_activations_into_conv_are_refused_up_front(tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"activation_type": "uint4"}))
    code, out, err = _check(capsys, _save(tmp_path, parse(CONV)), "--config", config)
    assert code == 2 and "QLinearConv has no uint4 kernel" in err and "give these tensors 8 bits" in out


def test_a_nan_weight_is_named(tmp_path, capsys):
    proto = parse(CONV)
    w = onnx.numpy_helper.to_array(proto.graph.initializer[0]).copy()
    w[0, 0, 0, 0] = np.nan
    proto.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(w, "w"))
    code, _, err = _check(capsys, _save(tmp_path, proto))
    assert code == 2 and "tensor 'w' holds NaN" in err


def test_a_custom_op_onnxruntime_cannot_run(tmp_path, capsys):
    proto = parse(CONV)
    proto.graph.node.append(helper.make_node("Frobnicate", ["y"], ["z"], name="custom", domain="com.example"))
    proto.graph.output[0].name = "z"
    proto.opset_import.append(helper.make_opsetid("com.example", 1))
    code, out, err = _check(capsys, _save(tmp_path, proto))
    assert code == 2
    assert "op com.example.Frobnicate x1: custom op" in out
    assert "onnxruntime cannot load the float model" in err


def test_a_contrib_op_stays_float(tmp_path, capsys):
    proto = parse(CONV)
    proto.graph.node.append(helper.make_node("Gelu", ["y"], ["z"], name="gelu", domain="com.microsoft"))
    proto.graph.output[0].name = "z"
    proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    code, out, _ = _check(capsys, _save(tmp_path, proto))
    assert code == 0 and "op com.microsoft.Gelu x1: contrib op" in out


def test_if_bodies_are_reported_and_their_weighted_ops_counted(tmp_path, capsys):
    f = onnx.TensorProto.FLOAT
    w = onnx.numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4) / 16, "w")
    ws = onnx.numpy_helper.from_array(np.eye(4, dtype=np.float32), "ws")
    then = helper.make_graph([helper.make_node("MatMul", ["h", "ws"], ["t"], name="then_mm")], "then", [],
                             [helper.make_tensor_value_info("t", f, [1, 4])])
    other = helper.make_graph([helper.make_node("Sigmoid", ["h"], ["e"], name="else_sig")], "else", [],
                              [helper.make_tensor_value_info("e", f, [1, 4])])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [1, 4]),
                                           helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", f, [1, 4])], [w, ws])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    code, out, _ = _check(capsys, _save(tmp_path, proto))
    assert code == 0
    assert "subgraphs: 2 bodies (If x1), 2 nodes" in out
    assert "MatMul x2: uint8 2" in out   # the main graph's and the then branch's


def test_bad_input_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, out, err = _check(capsys, tmp_path / "nope.onnx")
    assert code == 2 and err.count("\n") == 1 and "no such file" in err and not out
    code, out, err = _check(capsys, _save(tmp_path, parse(CONV)), "--config", bad)
    assert code == 2 and err.count("\n") == 1 and not out
