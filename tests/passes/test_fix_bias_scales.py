"""fix-bias-scales: tiny weights with a large bias (onnxruntime PR 22020's example), all weight kinds."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qpasses.analysis.bias_fixes import plan_bias_fixes
from qpasses.config.quant_config import QuantConfig, load_config
from qpasses.core.context import RunContext
from qpasses.core.pipeline import PassManager
from qpasses.core.verify import check_onnx
from qpasses.errors import PreconditionError
from qpasses.ir.annotations import TensorQuant
from qpasses.ir.model import from_proto
from qpasses.passes.compute_qparams import ComputeQParams
from qpasses.passes.fix_bias_scales import FixBiasScales
from qpasses.quant.qparams import INT32_MAX, compute_qparams, dequantize, quantize
from qpasses.quant.qtypes import qtype
from qpasses.testing import run as ort_run, run_pass

X_RANGE = (0.0, 12.75)
TINY = 1e-7
WEIGHT_KINDS = [("int8", True), ("uint8", False)]


def conv_weights(channels: int) -> np.ndarray:
    """(C, 2, 1, 1) weights of magnitude 1e-7 with alternating signs; a third channel is ordinary."""
    w = TINY * np.array([1.0, -1.0] * channels).reshape(channels, 2, 1, 1)
    if channels == 3:
        w[2] = [[[1e-3]], [[-1e-3]]]
    return w.astype(np.float32)


def conv_model(channels=2, per_channel=False, weight_type="int8", symmetric=True):
    """x (1,2,3,3) in [0, 12.75] -> Conv(1x1) -> y; bias [5, -4.5] (+ 0.01 for a third channel)."""
    w = conv_weights(channels)
    b = np.array([5.0, -4.5, 0.01][:channels], np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, 3, 3])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 10
    m = from_proto(proto)
    m.facts |= {"calibrated", "types-annotated"}
    x = feed()
    y = float_conv(x, w, b)
    m.ranges = {"x": X_RANGE, "y": (float(y.min()), float(y.max()))}
    m.quant["x"] = TensorQuant("uint8")
    m.quant["w"] = TensorQuant(weight_type, role="weight", symmetric=symmetric, axis=0 if per_channel else None)
    m.quant["b"] = TensorQuant("int32", role="bias", derived_from=["x", "w"])
    m.quant["y"] = TensorQuant("uint8")
    return m


def feed() -> np.ndarray:
    x = np.random.default_rng(0).uniform(*X_RANGE, size=(1, 2, 3, 3)).astype(np.float32)
    x.flat[0], x.flat[1] = X_RANGE
    return x


def float_conv(x, w, b):
    return np.einsum("nkhw,ck->nchw", x.astype(np.float64), w[:, :, 0, 0].astype(np.float64)) + b[None, :, None, None]


def qdq(m, name, values):
    tq = m.quant[name]
    q = quantize(values, tq.scale, tq.zero_point, tq.qtype, tq.axis)
    return dequantize(q, tq.scale, tq.zero_point, tq.axis)


def simulate(m):
    """The QDQ model's output computed from the table: Q/DQ on x, w, b and y around a float conv."""
    t = m.tensors()
    return qdq(m, "y", float_conv(qdq(m, "x", feed()), qdq(m, "w", t["w"].values), qdq(m, "b", t["b"].values)))


def qdq_proto(m) -> onnx.ModelProto:
    """The QDQ model built by hand from the table (insert-qdq's job), to check in onnxruntime."""
    t, inits = m.tensors(), []

    def dq(name, source):
        tq = m.quant[name]
        shape = [] if tq.axis is None else [len(tq.scale)]
        zp = np.array(tq.zero_point).astype(qtype(tq.qtype).storage).reshape(shape)
        inits.append(numpy_helper.from_array(np.array(tq.scale, np.float32).reshape(shape), f"{name}_scale"))
        inits.append(numpy_helper.from_array(zp, f"{name}_zero_point"))
        axis = {} if tq.axis is None else {"axis": tq.axis}
        return helper.make_node("DequantizeLinear", [source, f"{name}_scale", f"{name}_zero_point"],
                                [f"{name}_dq"], **axis)

    for name in ("w", "b"):
        tq = m.quant[name]
        q = quantize(t[name].values, tq.scale, tq.zero_point, tq.qtype, tq.axis)
        inits.append(numpy_helper.from_array(q, f"{name}_q"))
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero_point"], ["x_q"]), dq("x", "x_q"),
             dq("w", "w_q"), dq("b", "b_q"), helper.make_node("Conv", ["x_dq", "w_dq", "b_dq"], ["conv"]),
             helper.make_node("QuantizeLinear", ["conv", "y_scale", "y_zero_point"], ["y_q"]), dq("y", "y_q")]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 3])],
                              [helper.make_tensor_value_info("y_dq", TensorProto.FLOAT, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 10
    return proto


def run_passes(m, config=None, ctx=None, **fix):
    """compute-qparams then fix-bias-scales{fix} in ``ctx`` (or a new RunContext(config))."""
    ctx = ctx if ctx is not None else RunContext(config)
    ComputeQParams().run(m, ctx)
    return FixBiasScales(**fix).run(m, ctx)


def bias_fits(m) -> bool:
    tq, b = m.quant["b"], np.abs(m.tensors()["b"].values.astype(np.float64))
    return bool(np.all(b.reshape(-1) / np.asarray(tq.scale) < INT32_MAX))


@pytest.mark.parametrize("weight_type, symmetric", WEIGHT_KINDS)
@pytest.mark.parametrize("per_channel", [False, True])
def test_output_five_recovered(weight_type, symmetric, per_channel):
    m = conv_model(per_channel=per_channel, weight_type=weight_type, symmetric=symmetric)
    result = run_passes(m)
    assert result.modified and result.stats["weights_rescaled"] == 1
    y = simulate(m)
    assert abs(float(y[0, 0, 0, 0]) - 5.0) < 0.02
    assert abs(float(y[0, 1, 0, 0]) + 4.5) < 0.02
    assert bias_fits(m)
    w, x, b = m.quant["w"], m.quant["x"], m.quant["b"]
    np.testing.assert_allclose(b.scale, np.float32(x.scale[0]) * np.asarray(w.scale, np.float32), rtol=1e-6)
    ort_y = ort_run(qdq_proto(m), {"x": feed()})[0]
    assert abs(float(ort_y[0, 0, 0, 0]) - 5.0) < 0.02 and abs(float(ort_y[0, 1, 0, 0]) + 4.5) < 0.02


@pytest.mark.parametrize("weight_type, symmetric", WEIGHT_KINDS)
def test_without_fix_the_bias_clips(weight_type, symmetric):
    m = conv_model(weight_type=weight_type, symmetric=symmetric)
    result = run_passes(m, enabled=False)
    assert result.modified is False and not bias_fits(m)
    assert abs(float(simulate(m)[0, 0, 0, 0]) - 5.0) > 1.0


def test_config_switch_and_ort_option_disable_the_fix():
    assert load_config({"QDQDisableWeightAdjustForInt32Bias": True}).fix_bias_scales is False
    m, ctx = conv_model(), RunContext(QuantConfig(fix_bias_scales=False))
    result = run_passes(m, ctx=ctx)
    assert result.modified is False and result.stats == {"disabled": 1} and "bias_fixes" not in ctx.findings.as_dict()


@pytest.mark.parametrize("weight_type, symmetric", WEIGHT_KINDS)
def test_weight_range_still_covered_and_zero_point_rules(weight_type, symmetric):
    m = conv_model(per_channel=True, weight_type=weight_type, symmetric=symmetric)
    run_passes(m)
    w = m.quant["w"]
    values = m.tensors()["w"].values
    back = qdq(m, "w", values)
    assert np.all(np.abs(back - values) <= 0.5 * np.asarray(w.scale)[:, None, None, None] * (1 + 1e-6))
    # the zero point is re-derived for the raised scale, as compute_qparams would give it
    lo, hi = values.min(axis=(1, 2, 3)), values.max(axis=(1, 2, 3))
    scale, zp = compute_qparams(lo, hi, weight_type, symmetric=symmetric, min_scale=w.scale)
    assert list(scale) == w.scale and list(zp) == w.zero_point
    assert w.zero_point == ([0, 0] if symmetric else [2, 2])


def test_per_channel_raises_only_channels_that_need_it():
    m, ctx = conv_model(channels=3, per_channel=True), RunContext()
    ComputeQParams().run(m, ctx)
    before = list(m.quant["w"].scale)
    result = FixBiasScales().run(m, ctx)
    after = m.quant["w"].scale
    assert after[2] == before[2] and after[0] > before[0] and after[1] > before[1]
    assert result.stats == {"weights_rescaled": 1, "biases_fixed": 1, "channels_rescaled": 2}
    (fix,) = ctx.findings.as_dict()["bias_fixes"]
    assert fix["weight"] == "w" and fix["bias"] == "b" and fix["node"] == "conv" and fix["channels"] == [0, 1]
    assert fix["key"] == "w/b"
    assert fix["factor"] == pytest.approx(max(a / b for a, b in zip(after, before)))
    assert "fix-bias-scales: scale x" in m.quant["w"].why[-1] and "(channels [0, 1])" in m.quant["w"].why[-1]
    assert m.quant["b"].why[-1].startswith("fix-bias-scales: scale = scale('x')")
    y = simulate(m)
    assert abs(float(y[0, 0, 0, 0]) - 5.0) < 0.02


def test_per_tensor_single_factor_and_report():
    m, ctx = conv_model(), RunContext()
    ComputeQParams().run(m, ctx)
    old = m.quant["w"].scale[0]
    FixBiasScales().run(m, ctx)
    (fix,) = ctx.findings.as_dict()["bias_fixes"]
    assert fix["channels"] is None and fix["factor"] == pytest.approx(m.quant["w"].scale[0] / old)
    assert fix["factor"] > 50  # 5 / (0.05 * 1e-7 / 127) / 2^31 ~ 59


def test_idempotent_noop_and_checker_clean():
    m, ctx = conv_model(per_channel=True, weight_type="uint8", symmetric=False), RunContext()
    run_passes(m, ctx=ctx)
    table, report = m.quant.to_json(), list(ctx.findings.as_dict()["bias_fixes"])
    again = FixBiasScales().run(m, ctx)
    assert again.modified is False and m.quant.to_json() == table and ctx.findings.as_dict()["bias_fixes"] == report
    check_onnx(m)
    assert from_proto(m.to_proto()).quant == m.quant


def test_ordinary_model_is_left_alone():
    m = conv_model()
    m.tensors()["w"].values = np.array([0.5, -0.25, 0.125, 1.0], np.float32).reshape(2, 2, 1, 1)
    ctx = RunContext()
    ComputeQParams().run(m, ctx)
    table = m.quant.to_json()
    assert plan_bias_fixes(m, ctx.config) == {}
    result = FixBiasScales().run(m, ctx)
    assert result.modified is False and m.quant.to_json() == table and "bias_fixes" not in ctx.findings.as_dict()


def test_fixed_weight_is_not_rescaled():
    m = conv_model()
    run_pass(ComputeQParams(), m)
    m.quant["w"].fixed = True
    result = run_pass(FixBiasScales(), m)
    assert result.modified is False and "cannot be rescaled" in m.quant["b"].why[-1]


GEMM_W = TINY * np.array([[1.0, -1.0, 2.0], [-1.0, 1.0, -2.0]], np.float32)  # (K=2, N=3), transB=0


@pytest.mark.parametrize("weight_type, symmetric", WEIGHT_KINDS)
@pytest.mark.parametrize("bias_shape", [(3,), (1, 3)])
@pytest.mark.parametrize("per_channel", [False, True])
def test_gemm_bias_shapes(weight_type, symmetric, bias_shape, per_channel):
    b = np.array([5.0, 0.0, -4.5], np.float32).reshape(bias_shape)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc"),
         helper.make_node("Gemm", ["x", "w", "b2"], ["y2"], name="fc2")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 2])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 3]) for n in ("y", "y2")],
        [numpy_helper.from_array(GEMM_W, "w"), numpy_helper.from_array(b, "b"),
         numpy_helper.from_array(np.zeros(3, np.float32), "b2")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 10
    m = from_proto(proto)
    m.facts |= {"calibrated", "types-annotated"}
    m.ranges = {"x": X_RANGE}
    m.quant["x"] = TensorQuant("uint8")
    m.quant["w"] = TensorQuant(weight_type, role="weight", symmetric=symmetric, axis=1 if per_channel else None)
    m.quant["b"] = TensorQuant("int32", role="bias", derived_from=["x", "w"])
    m.quant["b2"] = TensorQuant("int32", role="bias", derived_from=["x", "w"])
    ctx = RunContext()
    ComputeQParams().run(m, ctx)
    assert m.quant["b"].axis == ((len(bias_shape) - 1) if per_channel else None)
    FixBiasScales().run(m, ctx)
    (fix,) = ctx.findings.as_dict()["bias_fixes"]
    assert fix["node"] == "fc" and fix["channels"] == ([0, 2] if per_channel else None)
    scale = np.asarray(m.quant["b"].scale)
    assert np.all(np.abs(b.reshape(-1)) / scale < INT32_MAX)
    assert m.quant["b2"].scale == m.quant["b"].scale  # same input and weight: rederived too
    back = qdq(m, "b", b)
    np.testing.assert_allclose(back, b, atol=float(scale.max()))
    x = np.full((4, 2), 12.75, np.float32)
    y = qdq(m, "x", x) @ qdq(m, "w", GEMM_W) + back.reshape(1, 3)
    np.testing.assert_allclose(y[0], [5.0, 0.0, -4.5], atol=0.02)
    if per_channel:
        assert m.quant["w"].scale[1] < m.quant["w"].scale[0]  # the zero-bias channel kept its scale
    assert run_pass(FixBiasScales(), m).modified is False


def test_pow2_and_fp16_scales_stay_valid_after_raise():
    cfg = load_config({"calibration": {"method": "pow2"}, "scale_type": "float16"})
    m = conv_model(per_channel=True)
    run_passes(m, cfg)
    for s in m.quant["w"].scale:
        assert np.log2(s) == np.round(np.log2(s)) and np.float16(s) == s
    assert bias_fits(m) and abs(float(simulate(m)[0, 0, 0, 0]) - 5.0) < 0.02


def test_precondition():
    m = conv_model()
    with pytest.raises(PreconditionError, match="qparams-computed"):
        PassManager([FixBiasScales()]).run(m)
    records = PassManager([ComputeQParams(), FixBiasScales()]).run(m)
    # no "bias-scales-fixed" fact any more (no pass read it): the rescaled table keeps the facts
    assert records[1].modified and {"calibrated", "types-annotated", "qparams-computed"} <= m.facts
