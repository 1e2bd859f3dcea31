"""Weight MatMuls whose output only float readers read: the output stays float, onnxruntime still
runs them as integer kernels (MatMulIntegerToFloat, or QGemm once MatMulAddFusion has taken the
bias Add: the bias must then be an int32 DequantizeLinear), and the output is exact to float."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import qpasses
from qpasses.evaluation.integer_kernels import integer_kernels
from qpasses.passes.annotate_types import AnnotateTypes
from qpasses.testing import model_from_text, run_pass

RNG = np.random.default_rng(0)
D, F = 16, 32


def _values(shape, scale=0.3):
    return ",".join(f"{v:.5f}" for v in RNG.normal(0, scale, size=shape).ravel())


# x -> MatMul(w1) + b1 -> residual Add -> LayerNorm -> MatMul(w2) + b2 -> Erf (a GELU-like float op)
BLOCK = """
g (float[1,8,%(d)d] x) => (float[1,8,%(f)d] y) <float[%(d)d,%(d)d] w1 = {%(w1)s}, float[%(d)d] b1 = {%(b1)s},
   float[%(d)d] g1 = {%(g1)s}, float[%(d)d,%(f)d] w2 = {%(w2)s}, float[%(f)d] b2 = {%(b2)s}> {
  [mm1] m1 = MatMul (x, w1)
  [bias1] a1 = Add (b1, m1)
  [res] r = Add (x, a1)
  [ln] n = LayerNormalization <axis = -1> (r, g1)
  [mm2] m2 = MatMul (n, w2)
  [bias2] a2 = Add (m2, b2)
  [act] y = Erf (a2)
}""" % {"d": D, "f": F, "w1": _values((D, D)), "b1": _values(D), "g1": _values(D, 1.0),
        "w2": _values((D, F)), "b2": _values(F)}


def _feeds(n, seed):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(0, 1, (1, 8, D)).astype(np.float32)} for _ in range(n)]


def _session(proto):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def quantized():
    model = qpasses.quantize(model_from_text(BLOCK), _feeds(16, 1))
    return model.to_proto()


def test_outputs_float_biases_int32_with_why():
    model = model_from_text(BLOCK)
    run_pass(AnnotateTypes(), model, {})
    assert not {"m1", "m2"} & set(model.quant)
    for bias, node in (("b1", "mm1"), ("b2", "mm2")):
        tq = model.quant[bias]
        assert (tq.role, tq.qtype, tq.axis) == ("bias", "int32", 0) and tq.derived_from[1] in ("w1", "w2")
        assert f"MatMul '{node}'" in tq.why[0] and "QGemm" in tq.why[0]
    assert "QGemm" in model.decisions["float"]["m1"]["reason"]
    assert run_pass(AnnotateTypes(), model, {}).modified is False   # the same table again


def test_runs_as_integer_kernels_and_the_output_is_exact(quantized):
    """Every weight MatMul is an integer kernel in onnxruntime's optimized graph (with a float bias
    it would be a float Gemm: 0), and each MatMul + bias output equals the float computation on the
    dequantized input and weight (an 8-bit output grid would be off by up to half its step)."""
    onnx.checker.check_model(quantized, full_check=True)
    assert integer_kernels(quantized) == 2
    graph = quantized.graph
    assert not [n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] in ("m1", "m2")]
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    writer = {o: n for n in graph.node for o in n.output}

    def dequantized(name):
        dq = writer[name]
        q = inits[dq.input[0]].astype(np.float64) if dq.input[0] in inits else None
        return q, dq

    feed = _feeds(1, 7)[0]
    probe = onnx.ModelProto()
    probe.CopyFrom(quantized)
    mm1 = next(n for n in graph.node if n.name == "mm1")
    bias1 = next(n for n in graph.node if n.name == "bias1")
    del probe.graph.output[:]
    probe.graph.output.extend([onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None)
                               for t in (mm1.input[0], "a1")])
    x_dq, a1 = _session(probe).run(None, feed)
    w_q, w_dq = dequantized(mm1.input[1])
    w = (w_q - inits[w_dq.input[2]].reshape(1, -1)) * inits[w_dq.input[1]].reshape(1, -1)
    b_q, b_dq = dequantized(next(i for i in bias1.input if i != "m1"))
    expected = x_dq.astype(np.float64) @ w + b_q * inits[b_dq.input[1]]
    step = float(np.abs(expected).max()) / 127
    assert np.max(np.abs(a1 - expected)) < step / 20


def test_a_matmul_added_to_a_computed_tensor_keeps_its_output_q():
    """MatMul -> Add(residual): onnxruntime would fuse them into a float Gemm (2-D), so the output
    keeps its Q (QLinearMatMul)."""
    text = """
    g (float[8,16] x) => (float[8,16] y) <float[16,16] w = {%s}> {
      [mm] m = MatMul (x, w)
      [res] y = Add (x, m)
    }""" % _values((16, 16))
    model = model_from_text(text)
    run_pass(AnnotateTypes(), model, {})
    assert "m" in model.quant
    q = qpasses.quantize(model_from_text(text), _feeds2d(8)).to_proto()
    assert integer_kernels(q) == 1


def _feeds2d(n):
    rng = np.random.default_rng(3)
    return [{"x": rng.normal(0, 1, (8, 16)).astype(np.float32)} for _ in range(n)]


def test_an_output_a_quantized_op_reads_keeps_its_q():
    text = """
    g (float[1,8,16] x) => (float[1,16,8] y) <float[16,16] w = {%s}> {
      [mm] m = MatMul (x, w)
      [tr] y = Transpose <perm = [0,2,1]> (m)
    }""" % _values((16, 16))
    model = model_from_text(text)
    run_pass(AnnotateTypes(), model, {})
    assert "m" in model.quant and model.quant["y"].shares == "m"


@pytest.mark.parametrize("act", ["Sigmoid", "Tanh", "Softmax"])
def test_a_gemm_read_by_a_float_activation_writes_float_as_qgemm(act):
    text = """
    g (float[4,16] x) => (float[4,8] y) <float[8,16] w = {%s}, float[8] b = {%s}> {
      [gemm] m = Gemm <transB = 1> (x, w, b)
      [act] y = %s (m)
    }""" % (_values((8, 16)), _values(8), act)
    rng = np.random.default_rng(5)
    feeds = [{"x": rng.normal(0, 1, (4, 16)).astype(np.float32)} for _ in range(8)]
    model = qpasses.quantize(model_from_text(text), feeds)
    assert "m" not in model.quant and model.quant["b"].qtype == "int32"
    assert "QGemm" in model.decisions["float"]["m"]["reason"]
    proto = model.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    assert integer_kernels(proto) == 1


def test_a_target_preset_keeps_the_output_q():
    """A target's provider (QNN) wants every quantized op between Q/DQ: the rule is for onnxruntime's CPU kernels."""
    model = model_from_text(BLOCK)
    run_pass(AnnotateTypes(), model, {"target": "qnn", "op_types_to_quantize": ["MatMul"]})
    assert {"m1", "m2"} <= set(model.quant) and "b1" not in model.quant
