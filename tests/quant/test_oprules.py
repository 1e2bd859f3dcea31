"""Sum (the n-ary Add of opset-9 ResNet residuals) is quantized like Add."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qpasses
from qpasses.evaluation.evaluate import judging_session
from qpasses.quant.oprules import ACTIVATION, rule_for

SHAPE = [1, 3, 8, 8]


def two_inputs(op: str) -> tuple[list, list, list]:
    """y = op(x, z): only the op's own rule can quantize anything."""
    return [helper.make_node(op, ["x", "z"], ["y"], name="residual")], ["x", "z"], []


def residual(op: str) -> tuple[list, list, list]:
    """conv1 -> relu (a) and conv2 (b) of x, then op(a, b) -> conv3 -> y."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)
             for name, shape in (("w1", (3, 3, 3, 3)), ("w2", (3, 3, 3, 3)), ("w3", (3, 3, 1, 1)))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["a"], name="relu"),
             helper.make_node("Conv", ["x", "w2"], ["b"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node(op, ["a", "b"], ["s"], name="residual"),
             helper.make_node("Conv", ["s", "w3"], ["y"], name="conv3")]
    return nodes, ["x"], inits


def build(kind, op: str, opset: int) -> onnx.ModelProto:
    nodes, inputs, inits = kind(op)
    graph = helper.make_graph(nodes, "sum", [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    return model


def feeds(model: onnx.ModelProto, n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{i.name: rng.normal(0, 1, SHAPE).astype(np.float32) for i in model.graph.input} for _ in range(n)]


def run(model: onnx.ModelProto, feed: dict) -> np.ndarray:
    """The output in onnxruntime's QDQ simulation (Q/DQ as written: the same on every CPU)."""
    return judging_session(model).run(None, feed)[0]


def test_every_sum_input_is_an_activation():
    rule = rule_for("Sum")
    assert rule is not None and rule.outputs == (0,) and not rule.shares and not rule.needs
    assert all(rule.slot(i).kind == ACTIVATION for i in range(4))


@pytest.mark.parametrize("kind", [two_inputs, residual], ids=["two-inputs", "residual"])
@pytest.mark.parametrize("opset", [9, 10, 13])
def test_two_input_sum_gets_qdq_like_add(kind, opset, tmp_path):
    # Add and Sum stay float by default: the subject here is Sum's rule, so select every op
    config = {"calibration": {"method": "minmax"}, "weight_symmetric": True, "op_types_to_quantize": "all"}
    out = {}
    for op in ("Add", "Sum"):
        model = build(kind, op, opset)
        quantized = qpasses.quantize(model, calibration_data=feeds(model, 8, 1), config=config)
        qpasses.save(quantized, tmp_path / f"{op}.onnx")
        out[op] = onnx.load(tmp_path / f"{op}.onnx")
    graph = out["Sum"].graph
    producer = {o: n.op_type for n in graph.node for o in n.output}
    readers = {i: n.op_type for n in graph.node for i in n.input}
    (node,) = [n for n in graph.node if n.name == "residual"]
    assert node.op_type == "Sum"
    assert [producer.get(i) for i in node.input] == ["DequantizeLinear", "DequantizeLinear"]
    assert readers.get(node.output[0]) == "QuantizeLinear"
    as_add = sorted("Add" if n.op_type == "Sum" else n.op_type for n in graph.node)
    assert as_add == sorted(n.op_type for n in out["Add"].graph.node)  # the same Q/DQ nodes as Add
    reference = build(kind, "Sum", opset)
    for feed in feeds(reference, 4, 2):
        y = run(out["Sum"], feed)
        np.testing.assert_array_equal(y, run(out["Add"], feed))  # same qparams, same rounding
        expected = run(reference, feed)
        assert 10 * np.log10(np.sum(expected ** 2) / np.sum((expected - y) ** 2)) > 25
