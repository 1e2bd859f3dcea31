"""The session quantized candidates are judged in: Q/DQ as written (never onnxruntime's integer
kernels), float optimizations on, and unoptimized for models too big to fold their weights."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qpasses.evaluation import evaluate
from qpasses.evaluation.evaluate import judging_session, session


def _qdq_conv() -> bytes:
    """uint8 activation Q/DQ, int8 per-channel weight DQ, Conv, Relu: what onnxruntime's default
    level fuses into QLinearConv."""
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (8, 4, 3, 3)).astype(np.int8)
    inits = [numpy_helper.from_array(w, "w_q"),
             numpy_helper.from_array(np.full(8, 0.01, np.float32), "w_s"),
             numpy_helper.from_array(np.zeros(8, np.int8), "w_z"),
             numpy_helper.from_array(np.array(0.02, np.float32), "x_s"),
             numpy_helper.from_array(np.array(128, np.uint8), "x_z"),
             numpy_helper.from_array(np.array(0.05, np.float32), "y_s"),
             numpy_helper.from_array(np.array(0, np.uint8), "y_z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_s", "x_z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["wd"], axis=0),
             helper.make_node("Conv", ["xd", "wd"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("QuantizeLinear", ["r", "y_s", "y_z"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "y_s", "y_z"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


def test_float_optimizations_on_integer_kernels_off():
    sess = judging_session(_qdq_conv())
    opts = sess.get_session_options()
    assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert opts.get_session_config_entry("session.disable_quant_qdq") == "1"
    assert opts.intra_op_num_threads == 1


def test_judged_outputs_are_the_unoptimized_simulation():
    model = _qdq_conv()
    x = {"x": np.random.default_rng(1).normal(0, 1, (1, 4, 8, 8)).astype(np.float32)}
    judged = judging_session(model).run(None, x)[0]
    plain = session(model, optimize=False, threads=1).run(None, x)[0]
    # the same codes but where float kernels round a product differently: one output step at most
    assert np.abs(judged - plain).max() <= 0.05 + 1e-6
    assert np.mean(judged == plain) > 0.99


def test_big_models_are_judged_unoptimized(monkeypatch):
    monkeypatch.setattr(evaluate, "JUDGED_FOLDING_BYTES", 100)
    opts = judging_session(_qdq_conv()).get_session_options()
    assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
