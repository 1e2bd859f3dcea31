"""int8 activations at opset 21: a float data-movement op after an int8 DequantizeLinear gets a Q/DQ
of its own, so onnxruntime loads the model, and the values do not change."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import parser

from qpasses.ir.model import from_proto
from qpasses.quant.int8_movers import requantize_movers

MOVERS = {"Reshape": "Reshape (d, shape)", "Transpose": "Transpose <perm = [1, 0]> (d)",
          "Squeeze": "Squeeze (d, axis0)", "Unsqueeze": "Unsqueeze (d, axis0)", "Slice": "Slice (d, start, end, axis1)"}


def _model(op: str, opset: int = 21, zero: str = "int8 z = {3}"):
    return parser.parse_model(f"""<ir_version: 10, opset_import: ["" : {opset}]>
    g (float[1,4] x) => (float[] y, float[1,4] z2) <float s = {{0.05}}, {zero}, int64[2] shape = {{2, -1}},
        int64[1] axis0 = {{0}}, int64[1] axis1 = {{1}}, int64[1] start = {{1}}, int64[1] end = {{3}}> {{
        q = QuantizeLinear (x, s, z)
        d = DequantizeLinear (q, s, z)
        y = {MOVERS[op]}
        z2 = Relu (d)
    }}""")


def _run(proto, level):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = level
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": np.array([[0.31, -0.74, 1.2, 0.05]], np.float32)})


@pytest.mark.parametrize("op", sorted(MOVERS))
def test_the_mover_gets_a_pair_and_the_model_loads_with_the_same_values(op):
    proto = _model(op)   # onnxruntime 1.32 cannot load it at ORT_ENABLE_ALL
    model = from_proto(proto)
    assert requantize_movers(model) == [next(n.name for n in model.graph.nodes if n.op == op)]
    fixed = model.to_proto()
    exact = _run(proto, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        for want, got in zip(exact, _run(fixed, level)):
            np.testing.assert_array_equal(got, want)
    assert requantize_movers(model) == []   # its output is quantized now


def test_a_chain_of_movers_gets_a_pair_after_each():
    proto = parser.parse_model("""<ir_version: 10, opset_import: ["" : 21]>
    g (float[1,4] x) => (float[1,1,2,2] y) <float s = {0.05}, int8 z = {3}, int64[4] shape = {1, 1, 2, 2}> {
        q = QuantizeLinear (x, s, z)
        d = DequantizeLinear (q, s, z)
        r = Reshape (d, shape)
        y = MaxPool <kernel_shape = [2, 2], pads = [0, 0, 1, 1], strides = [1, 1]> (r)
    }""")
    model = from_proto(proto)
    assert sorted(requantize_movers(model)) == sorted(n.name for n in model.graph.nodes if n.op in ("Reshape", "MaxPool"))
    exact = _run(proto, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    np.testing.assert_array_equal(_run(model.to_proto(), ort.GraphOptimizationLevel.ORT_ENABLE_ALL)[0], exact[0])


@pytest.mark.parametrize("opset, zero", [(19, "int8 z = {3}"), (21, "uint8 z = {131}")])
def test_older_opsets_and_uint8_are_left_alone(opset, zero):
    model = from_proto(_model("Reshape", opset, zero))
    assert requantize_movers(model) == []
