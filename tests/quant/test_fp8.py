"""FP8 (float8e4m3fn, float8e5m2): the math against onnxruntime's QuantizeLinear, and whole models
quantized per tensor and per channel that load and run in onnxruntime CPU."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qpasses
from qpasses.config.quant_config import load_config
from qpasses.evaluation.evaluate import session, snr_db
from qpasses.quant.qparams import compute_qparams, dequantize, quantize
from qpasses.quant.qtypes import qtype
from qpasses.testing import model_from_text, parse, random_feed, run

FP8 = {"float8e4m3fn": (448.0, TensorProto.FLOAT8E4M3FN), "float8e5m2": (57344.0, TensorProto.FLOAT8E5M2)}


def _qdq_model(qt: str, scale: np.ndarray, axis: int | None, shape) -> onnx.ModelProto:
    zp = np.zeros(scale.shape, qtype(qt).storage)
    attrs = {} if axis is None else {"axis": axis}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], **attrs),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], **attrs),
             helper.make_node("DequantizeLinear", ["q", "one", "z0"], ["qv"])]   # the FP8 values, exactly
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape),
                           helper.make_tensor_value_info("qv", TensorProto.FLOAT, shape)],
                          [numpy_helper.from_array(scale.astype(np.float32), "s"),
                           numpy_helper.from_array(np.float32(1), "one"), helper.make_tensor("z0", FP8[qt][1], [], [0]),
                           helper.make_tensor("z", FP8[qt][1], list(zp.shape), zp.astype(np.float32).ravel())])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=10)


@pytest.mark.parametrize("qt", FP8)
@pytest.mark.parametrize("axis", [None, 1])
def test_quantize_matches_onnxruntime_bit_for_bit(qt, axis):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 4, 5)) * np.array([0.01, 1, 30, 1e4])[None, :, None]).astype(np.float32)
    lo, hi = (x.min(), x.max()) if axis is None else (x.min(axis=(0, 2)), x.max(axis=(0, 2)))
    scale, zp = compute_qparams(lo, hi, qt)
    assert np.all(zp == 0)
    np.testing.assert_allclose(scale, np.float32(np.maximum(-lo, hi) / FP8[qt][0]), rtol=1e-7)
    x[0, :, 0] *= 4   # beyond the calibrated range: saturates (no inf/NaN)
    y, q = session(_qdq_model(qt, np.asarray(scale), axis, list(x.shape))).run(None, {"x": x})
    mine = quantize(x, scale, zp, qt, axis)
    assert mine.dtype == qtype(qt).storage
    np.testing.assert_array_equal(mine.astype(np.float32), q)
    np.testing.assert_array_equal(dequantize(mine, scale, zp, axis), y)
    assert np.isfinite(y).all() and np.abs(mine.astype(np.float32)).max() == FP8[qt][0]


def test_config_spellings():
    cfg = load_config({"activation_type": "QFLOAT8E4M3FN", "weight_type": "float8_e5m2"})
    assert (cfg.activation_type, cfg.weight_type, cfg.weight_symmetric) == ("float8e4m3fn", "float8e5m2", True)
    assert qtype("float8e4m3fn").bits == 8 and qtype("float8e4m3fn").min_opset == 19


CNN = """
g (float[1,3,8,8] x) => (float[1,6] y) <{w1}, {w2}, {fw}, float[6] fb = {{0.1,-0.2,0.3,0,0.05,-0.1}}>
{{
  c1 = Conv <pads=[1,1,1,1]> (x, w1)
  r1 = Relu(c1)
  p = MaxPool <kernel_shape=[2,2], strides=[2,2]> (r1)
  c2 = Conv (p, w2)
  r2 = Relu(c2)
  f = Flatten(r2)
  y = Gemm <transB=1> (f, fw, fb)
}}
"""


def _const(name, shape, seed):
    v = np.random.default_rng(seed).standard_normal(shape) * 0.3
    return f"float[{','.join(map(str, shape))}] {name} = {{{','.join(f'{a:.5f}' for a in v.ravel())}}}"


def _cnn():
    return model_from_text(CNN.format(w1=_const("w1", (4, 3, 3, 3), 1), w2=_const("w2", (4, 4, 1, 1), 2),
                                      fw=_const("fw", (6, 64), 3)))


@pytest.mark.parametrize("qt", FP8)
@pytest.mark.parametrize("per_channel", [True, False])
def test_pipeline_writes_fp8_qdq_that_runs_in_onnxruntime(qt, per_channel):
    feeds = [random_feed(_cnn(), seed=s) for s in range(8)]
    float_model = _cnn().to_proto()
    config = {"activation_type": qt, "weight_type": qt, "per_channel": per_channel, "op_types_to_quantize": "all"}
    model = qpasses.quantize(_cnn(), feeds, config)
    proto = model.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    assert model.opset >= 19
    types = {i.data_type for i in proto.graph.initializer if i.name.endswith("_quantized")}
    assert FP8[qt][1] in types
    scales = [numpy_helper.to_array(i) for i in proto.graph.initializer if i.name == "w1_scale"]
    assert scales and scales[0].size == (4 if per_channel else 1)
    assert not any(n.op_type == "Relu" for n in proto.graph.node)   # Max(x, 0): see qpasses/quant/fp8.py
    floor = {"float8e4m3fn": 22.0, "float8e5m2": 12.0}[qt]   # 3 / 2 mantissa bits, 6 quantized tensors
    for feed in feeds[:4]:
        ref = run(float_model, feed)[0]
        fused, plain = session(proto).run(None, feed)[0], session(proto, optimize=False).run(None, feed)[0]
        np.testing.assert_allclose(fused, plain, rtol=1e-5, atol=1e-5)
        assert snr_db(ref, fused) > floor


def test_relu_before_fp8_quantize_is_kept_in_onnxruntime():
    """onnxruntime drops a Relu feeding an FP8 QuantizeLinear; written as Max it survives."""
    text = """
    g (float[1,2,4,4] x) => (float[1,2,4,4] y) <float s = {0.01}, float8e4m3fn z = {0}>
    {
      a = Relu(x)
      q = QuantizeLinear(a, s, z)
      y = DequantizeLinear(q, s, z)
    }"""
    x = {"x": np.random.default_rng(0).standard_normal((1, 2, 4, 4)).astype(np.float32)}
    broken = parse(text, opset=19)
    assert session(broken).run(None, x)[0].min() < 0   # the onnxruntime behaviour qpasses works around
    from qpasses.ir.model import from_proto
    from qpasses.quant.fp8 import guard_relus

    model = from_proto(broken)
    assert guard_relus(model) == 1 and guard_relus(model) == 0
    assert session(model).run(None, x)[0].min() == 0
    assert ml_dtypes.float8_e4m3fn(0) == 0
