"""Parity with onnxruntime's quantizer where users compare: each check runs onnxruntime's own code."""
from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings, strategies as st
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.execution_providers.qnn.mixed_precision_overrides_utils import (
                                                                                              MixedPrecisionTensorQuantOverridesFixer,
                                                                                              )
from onnxruntime.quantization.quant_utils import (compute_data_quant_params, compute_scale_zp,
                                                  get_qmin_qmax_for_qType, update_opset_version)
from onnxruntime.quantization.tensor_quant_overrides import TensorQuantOverridesHelper

import qpasses
from qpasses.core.pipeline import default_pipeline, parse_pipeline
from qpasses.ir.model import load
from qpasses.quant.qparams import compute_qparams, value_range
from qpasses.quant.qtypes import qtype
from qpasses.quant.upgrade import upgrade_opset
from qpasses.testing import parse, random_feed

from tests.kits.example_graphs import ORT_PR_20028

TYPES = ["uint8", "int8", "uint16", "int16", "uint4", "int4"]


# -- integer limits: onnxruntime's get_qmin_qmax_for_qType -------------------------------------------
@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("name", TYPES)
def test_limits_match_onnxruntime(name, symmetric, reduce_range):
    qt = qtype(name)
    expected = get_qmin_qmax_for_qType(qt.onnx_type, reduce_range=reduce_range, symmetric=symmetric)
    assert qt.limits(symmetric, reduce_range) == (int(expected[0]), int(expected[1]))


def test_reduce_range_symmetric_int8_is_minus_64_to_64():
    assert qtype("int8").limits(symmetric=True, reduce_range=True) == (-64, 64)


# -- scale and zero point: onnxruntime's compute_scale_zp, bit for bit -------------------------------
def ort_qparams(rmin, rmax, name, symmetric=False, reduce_range=False, minimum_real_range=None):
    """(float32 scale, int zero point) from onnxruntime for float32 bounds."""
    qmin, qmax = get_qmin_qmax_for_qType(qtype(name).onnx_type, reduce_range=reduce_range, symmetric=symmetric)
    zp, scale = compute_scale_zp(np.array(rmin, np.float32), np.array(rmax, np.float32), qmin, qmax,
                                 symmetric, minimum_real_range)
    return np.float32(scale), int(zp)


def ours(rmin, rmax, name, **kw):
    scale, zp = compute_qparams(rmin, rmax, name, **kw)
    assert np.float32(scale) == scale   # a float32 value, held as float64
    return np.float32(scale), int(zp)


def same_bits(a: np.float32, b: np.float32) -> bool:
    return np.float32(a).view(np.uint32) == np.float32(b).view(np.uint32)


@pytest.mark.parametrize("rmin, rmax, name, kw", [
    (-2.0, 2.0, "uint8", {}),                       # 127.5 -> 128 (qpasses gave 127)
    (-1.0, 3.0, "uint8", {}),
    (-0.75, 0.25, "int8", {}),
    (-1.0, 1.0, "uint8", {"symmetric": True}),      # zero point 128, scale 2/255
    (-3.0, 1.0, "int4", {"symmetric": True}),       # [-8, 7]: zero point round(-0.5) = 0
    (-1.0, 1.0, "int8", {"symmetric": True, "reduce_range": True}),   # [-64, 64]
    (0.0, 0.0, "uint8", {"symmetric": True}),       # degenerate: scale 1, zero point 0
    (0.0, 1e-37, "int16", {}),                      # scale below float32's tiny: degenerate
    (0.0, 1e-6, "uint8", {"minimum_real_range": 1e-4}),
])
def test_known_cases_match_onnxruntime(rmin, rmax, name, kw):
    expected = ort_qparams(rmin, rmax, name, **kw)
    got = ours(rmin, rmax, name, **kw)
    assert same_bits(got[0], expected[0]) and got[1] == expected[1], (got, expected)


def test_uint8_weights_spanning_minus_2_to_2_get_zero_point_128():
    assert ours(-2.0, 2.0, "uint8") == ort_qparams(-2.0, 2.0, "uint8") == (np.float32(4 / 255), 128)


bound = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),            # any float32, subnormals too
    st.floats(-1e4, 1e4, width=32),
    st.integers(-4096, 4096).map(lambda k: k / 16),                       # zero points on .5 ties
    st.sampled_from([0.0, -0.0, 1e-38, -1e-45, 3.4e38, -3.4e38]),
)


@settings(deadline=None, derandomize=True, max_examples=500)
@given(bound, bound, st.sampled_from(TYPES), st.booleans(), st.booleans(),
       st.sampled_from([None, 0.0, 1e-4, 0.01, 1.0]))
def test_compute_scale_zp_bit_for_bit(a, b, name, symmetric, reduce_range, minimum_real_range):
    rmin, rmax = float(np.float32(min(a, b))), float(np.float32(max(a, b)))
    kw = {"symmetric": symmetric, "reduce_range": reduce_range, "minimum_real_range": minimum_real_range}
    with np.errstate(over="ignore"):   # onnxruntime's float32 arithmetic may overflow near 3.4e38
        expected = ort_qparams(rmin, rmax, name, **kw)
    got = ours(rmin, rmax, name, **kw)
    assert same_bits(got[0], expected[0]) and got[1] == expected[1], (got, expected)


@pytest.mark.parametrize("name, symmetric", [("int8", True), ("uint8", False), ("int4", True), ("uint16", False)])
def test_per_channel_weights_match_compute_data_quant_params(name, symmetric):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((6, 3, 3, 3)) * rng.random((6, 1, 1, 1))).astype(np.float32)
    w[2] = 0.0   # an all-zero channel
    lo, hi = value_range(w, axis=0)
    scales, zps = compute_qparams(lo, hi, name, symmetric=symmetric)
    for c in range(w.shape[0]):
        zp, scale = compute_data_quant_params(w[c].ravel(), qtype(name).onnx_type, symmetric)
        assert same_bits(np.float32(scales[c]), np.float32(scale)) and int(zps[c]) == int(zp)


# -- models below opset 10: upgraded to 11 as onnxruntime's quantize_static does ----------------------
LIGHT_RESNET50 = os.path.join(os.path.dirname(onnx.__file__), "backend/test/data/light/light_resnet50.onnx")
NOTICE = "upgraded from opset 9 to 11 as onnxruntime's quantizer does"

OPSET9 = """
g (float[1,2,6,6] x) => (float[1,2,6,6] y)
  <float[2,2,3,3] w = {0.1,-0.2,0.3,0.4,-0.5,0.6,0.7,-0.8,0.9,0.1,0.2,-0.3,0.4,0.5,-0.6,0.7,0.8,0.9,
                       -0.1,0.2,0.3,-0.4,0.5,0.6,-0.7,0.8,0.9,0.1,-0.2,0.3,0.4,-0.5,0.6,0.7,-0.8,0.9},
   float[2] s = {1.5, 0.5}, float[2] b = {0.1, -0.2}, float[2] m = {0, 0.3}, float[2] v = {1, 2}> {
  c = Conv <pads = [1, 1, 1, 1]> (x, w)
  n = BatchNormalization (c, s, b, m, v)
  r = Relu (n)
  y = Sum (r, x)
}"""


def _feeds(shape, n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


def _check_quantized(model, feed):
    proto = model.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    assert proto.opset_import[0].version >= 11
    assert any(n.op_type == "QuantizeLinear" for n in proto.graph.node)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    assert np.all(np.isfinite(session.run(None, feed)[0]))


def test_upgrade_gives_the_opset_and_ops_of_onnxruntimes_update_opset_version():
    proto = onnx.load(LIGHT_RESNET50)
    expected = update_opset_version(proto, QuantType.QUInt8)
    upgraded, notice = upgrade_opset(proto)
    assert proto.opset_import[0].version == 9   # the caller's proto is not modified
    assert [(o.domain, o.version) for o in upgraded.opset_import] == \
        [(o.domain, o.version) for o in expected.opset_import] == [("", 11)]
    assert [n.op_type for n in upgraded.graph.node] == [n.op_type for n in expected.graph.node]
    assert NOTICE in notice and notice.startswith("qpasses: note: ")
    assert upgrade_opset(expected) is None and upgrade_opset(load(expected)) is None


def test_small_opset9_model_quantizes_with_a_notice(capsys):
    feeds = _feeds((1, 2, 6, 6), 4)
    model = qpasses.quantize(parse(OPSET9, opset=9), feeds)
    assert capsys.readouterr().err.count(NOTICE) == 1
    _check_quantized(model, feeds[0])


def test_folding_only_pipeline_keeps_opset9_without_notice(capsys):
    model, _ = qpasses.run_pipeline(parse(OPSET9, opset=9))
    assert model.opset == 9 and "BatchNormalization" not in {n.op for n in model.graph.nodes}
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("config", [
    {"calibration": {"method": "minmax"}, "per_channel": True},
    pytest.param(None, marks=pytest.mark.slow),          # the default config: select-by-snr scores variants
])
def test_light_resnet50_opset9_quantizes_end_to_end(config, capsys):
    feeds = [{"gpu_0/data_0": f["x"]} for f in _feeds((1, 3, 224, 224), 2 if config is None else 1)]
    model, records = qpasses.run_pipeline(LIGHT_RESNET50, calibration_data=feeds, config=config)
    assert capsys.readouterr().err.count(NOTICE) == 1
    assert [r.name for r in records] == [p.name for p in parse_pipeline(default_pipeline(quantize=True))]
    _check_quantized(model, feeds[0])


# -- mixed precision: the same tensors at 16 bit as onnxruntime's quantize_static ---------------------
INT16 = {"quant_type": "int16", "symmetric": True}
ORT_INT16 = {"quant_type": QuantType.QInt16, "symmetric": True}
SIXTEEN_BIT = (onnx.TensorProto.INT16, onnx.TensorProto.UINT16)
# quantize_static quantizes every op it has a rule for; qpasses leaves Mul (and other element-wise
# ops) float by default, so the parity tests select every op
ALL = {"op_types_to_quantize": "all"}


class _Reader(CalibrationDataReader):
    def __init__(self, feeds):
        self.feeds = iter(feeds)

    def get_next(self):
        return next(self.feeds, None)


def _q_types(proto: onnx.ModelProto) -> dict[str, int]:
    """{tensor, or '<tensor>_convert': zero-point type} of every QuantizeLinear, from the output
    names qpasses ('<x>_quantized') and onnxruntime ('<x>_QuantizeLinear_Output') give them."""
    zero_points = {t.name: t.data_type for t in proto.graph.initializer}
    return {n.output[0].removesuffix("_QuantizeLinear_Output").removesuffix("_quantized"): zero_points[n.input[2]]
            for n in proto.graph.node if n.op_type == "QuantizeLinear"}


def _sixteen_bit(proto: onnx.ModelProto) -> set[str]:
    return {name for name, t in _q_types(proto).items() if t in SIXTEEN_BIT}


def _ort_quantized(model, feeds, overrides, tmp_path) -> onnx.ModelProto:
    onnx.save(model, tmp_path / "float.onnx")
    quantize_static(tmp_path / "float.onnx", tmp_path / "ort.onnx", _Reader(feeds), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    extra_options={"TensorQuantOverrides": overrides})
    return onnx.load(tmp_path / "ort.onnx")


@pytest.fixture(scope="module")
def example():
    model = parse(ORT_PR_20028, opset=21)
    return model, [random_feed(model, seed) for seed in range(8)]


def test_tensor_overrides_put_the_same_tensors_at_16_bit_as_quantize_static(example, tmp_path):
    """A reader of a 16-bit tensor (the Mul reading op4_out) keeps the default type for its output."""
    model, feeds = example
    ours = qpasses.quantize(model, feeds, {"activation_type": "int8", "tensor_overrides": {"op4_out": [INT16]}, **ALL})
    ort_model = _ort_quantized(model, feeds, {"op4_out": [ORT_INT16]}, tmp_path)
    assert _sixteen_bit(ours.to_proto()) == _sixteen_bit(ort_model) == {"op4_out"}


def test_mixed_precision_regions_match_quantize_static_with_onnxruntimes_fixer(example, tmp_path):
    """onnxruntime's MixedPrecisionTensorQuantOverridesFixer computes the requested tensor's producer
    and readers in 16 bit (the Mul's output too, converted back to int8 for the Relu reading it);
    propagate-mixed-precision{extend_through_shape_ops=false} gives the same Q/DQ types."""
    model, feeds = example
    helper = TensorQuantOverridesHelper({"op4_out": [dict(ORT_INT16)]})
    fixer = MixedPrecisionTensorQuantOverridesFixer.create_from_model(helper, model, QuantType.QInt8)
    fixer.apply(QuantType.QInt8, False)
    ort_model = _ort_quantized(model, feeds, helper.get_dict(), tmp_path)
    config = {"activation_type": "int8", "mixed_precision": {"op4_out": INT16}, **ALL}
    passes = default_pipeline(quantize=True).replace(
        "propagate-mixed-precision", "propagate-mixed-precision{extend_through_shape_ops=false}")
    ours = qpasses.run_pipeline(model, passes, config=config, calibration_data=feeds)[0]
    assert _q_types(ours.to_proto()) == _q_types(ort_model)
    assert _sixteen_bit(ort_model) == {"op2_out_convert", "op3_out_convert", "op4_out", "op5_out"}
    # by default the region also takes the Relu that shares the Mul's qparams, and says why
    default = qpasses.quantize(model, feeds, config)
    assert _sixteen_bit(default.to_proto()) == _sixteen_bit(ort_model) | {"output_0"}
    assert any("region of 'op4_out'" in line and "tied to op5" in line for line in default.quant["output_0"].why)


# -- weights the model computes: quantize_static quantizes them as activations ---------------------
CONSTANT_WEIGHT_CONV = """
g (float[1, 4, 8, 8] x) => (float[1, 8, 8, 8] y) {
    w = Constant <value = float[8, 4, 3, 3] {%s}> ()
    c = Conv <pads = [1, 1, 1, 1]> (x, w)
    y = Relu(c)
}
"""


def _weight_grid(proto: onnx.ModelProto) -> tuple:
    """(scale, zero point, its dtype) of the Conv's weight DequantizeLinear."""
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    writer = {o: n for n in proto.graph.node for o in n.output}
    conv = next(n for n in proto.graph.node if n.op_type == "Conv")
    dq = writer[conv.input[1]]
    zp = inits[dq.input[2]]
    return float(inits[dq.input[1]]), int(zp), zp.dtype


@pytest.mark.parametrize("config", [{"target": "onnxruntime"},
                                    {"per_channel": False, "computed_weights": "activation"}])
def test_a_constant_node_weight_gets_quantize_statics_activation_grid(config, tmp_path):
    """quantize_static quantizes a weight held in a Constant node as an activation (uint8, asymmetric,
    its min/max): the onnxruntime preset and ``computed_weights: activation`` give the same grid;
    by default it is an int8 weight."""
    values = np.random.default_rng(0).standard_normal(8 * 4 * 9) * 0.3 + 0.1
    model = parse(CONSTANT_WEIGHT_CONV % ", ".join(f"{v:.4f}" for v in values))
    feeds = [random_feed(model, seed) for seed in range(8)]
    onnx.save(model, tmp_path / "float.onnx")
    quantize_static(tmp_path / "float.onnx", tmp_path / "ort.onnx", _Reader(feeds), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=False)
    expected = _weight_grid(onnx.load(tmp_path / "ort.onnx"))
    ours = _weight_grid(qpasses.quantize(model, feeds, config).to_proto())
    assert expected[2] == ours[2] == np.uint8 and expected[1] != 0
    assert ours[:2] == pytest.approx(expected[:2], rel=1e-6)
    default = _weight_grid(qpasses.quantize(model, feeds, {"per_channel": False, "cpu": "x86-64-vnni"}).to_proto())
    assert default[2] == np.int8   # (with cpu x86-64, protect-pair-sums may store it as uint8 on the same grid)
