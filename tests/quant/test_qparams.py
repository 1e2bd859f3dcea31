"""Quantization math: exact hand-computed cases and hypothesis properties."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from qpasses.quant.qparams import (INT32_MAX, bias_min_scale, bias_qparams, compute_qparams, dequantize,
                                   fit_scale, midpoint, prepare_range, quantize, round_up_pow2, value_range)
from qpasses.quant.qtypes import qtype

PROPS = settings(deadline=None, derandomize=True, max_examples=300)
TYPES = ["uint8", "int8", "uint16", "int16", "uint4", "int4"]


def up32(x):
    """The smallest float32 >= x, computed independently of fit_scale."""
    f = np.float32(x)
    return float(np.nextafter(f, np.float32(np.inf)) if float(f) < x else f)


def f32(x):
    """The nearest float32 (scales are stored so, as onnxruntime stores them; ranges are float32)."""
    return float(np.float32(x))


def qp(rmin, rmax, qt="uint8", **kw):
    scale, zp = compute_qparams(rmin, rmax, qt, **kw)
    return float(scale), int(zp)


# -- exact cases --------------------------------------------------------------------------------
def test_asymmetric_uint8():
    assert qp(0.0, 12.75) == (f32(0.05), 0)
    scale, zp = qp(-1.0, 3.0)
    assert scale == f32(4.0 / 255) and zp == 64  # 255/4 = 63.75 -> 64
    assert qp(-2.0, 2.0) == (f32(4.0 / 255), 128)  # 127.5 -> 128 (half even, from the float64 scale)


def test_asymmetric_range_widened_to_contain_zero():
    assert qp(2.0, 4.0) == qp(0.0, 4.0)
    assert qp(-4.0, -2.0, "int8") == qp(-4.0, 0.0, "int8")
    assert qp(-4.0, -2.0, "int8")[1] == 127


def test_symmetric_signed_is_narrow_with_zero_zp():
    assert qp(-0.5, 1.27, "int8", symmetric=True) == (f32(f32(1.27) / 127), 0)
    assert qp(-2.0, 1.0, "int16", symmetric=True) == (f32(2.0 / 32767), 0)


def test_symmetric_unsigned_zero_point_is_midpoint():
    assert qp(-1.0, 1.0, "uint8", symmetric=True) == (f32(2 / 255), 128)
    assert qp(0.0, 3.0, "uint16", symmetric=True) == (f32(6 / 65535), 32768)
    assert midpoint(0, 255) == 128 and midpoint(0, 65535) == 32768 and midpoint(0, 15) == 8


def test_restricted_asymmetric_uint8():
    assert qp(0.0, 2.0, restricted=True) == (f32(2 / 255), 0)
    assert qp(0.5, 2.0, restricted=True) == (f32(2 / 255), 0)
    assert qp(-1.0, 2.0, restricted=True) == (f32(max(1 / 128, 2 / 127)), 128)
    assert qp(-3.0, 0.5, restricted=True) == (f32(3 / 128), 128)
    scale, zp = qp(0.0, 0.0, restricted=True)
    assert zp == 0 and np.isfinite(scale) and scale > 0


def test_reduce_range():
    assert qp(0.0, 1.27, "uint8", reduce_range=True) == (f32(f32(1.27) / 127), 0)
    assert qp(-0.5, 0.5, "int8", symmetric=True, reduce_range=True) == (f32(1 / 128), 0)  # [-64, 64]


def test_minimum_real_range():
    assert qp(0.0, 1e-6, minimum_real_range=1e-4) == (f32(f32(1e-4) / 255), 0)
    assert qp(0.0, 1.0, minimum_real_range=1e-4) == qp(0.0, 1.0)
    assert qp(0.0, 0.0, minimum_real_range=0.255)[0] == f32(f32(0.255) / 255)


def test_power_of_two_rounds_up():
    scale, zp = qp(-0.3, 12.75, power_of_two=True)
    assert scale == 0.0625 and zp == 5
    assert qp(0.0, 255 * 0.25, power_of_two=True) == (0.25, 0)
    np.testing.assert_array_equal(round_up_pow2([0.3, 0.25, 3e-9]), [0.5, 0.25, 2.0**-28])


def test_float16_scales_are_representable_and_normal():
    tiny16 = float(np.finfo(np.float16).tiny)
    scale, zp = qp(-0.3, 1e-6, scale_type="float16")
    assert np.float16(scale) == scale and scale >= 0.3 / 255 and zp == 255
    assert qp(0.0, 1e-9, scale_type="float16")[0] == tiny16
    assert qp(0.0, 1e12, scale_type="float16")[0] == 65504.0
    np.testing.assert_array_equal(fit_scale([0.0, 1e-45, np.inf], "float32"),
                                  [np.finfo(np.float32).tiny, np.finfo(np.float32).tiny, np.finfo(np.float32).max])


def test_degenerate_ranges_get_scale_one_and_zero_point_zero():
    """As onnxruntime: also symmetric uint8, and ranges whose scale would be below float32's tiny."""
    for rmin, rmax in [(0.0, 0.0), (np.nan, 1.0), (-np.inf, 2.0), (0.0, np.inf), (np.nan, np.nan), (0.0, 1e-37)]:
        for qt, sym in [("uint8", False), ("int8", False), ("int8", True), ("uint8", True)]:
            assert qp(rmin, rmax, qt, symmetric=sym) == (1.0, 0)
    assert prepare_range(np.nan, 3.0)[1] == 0.0


def test_min_scale_raises_and_rederives_zero_point():
    scale, zp = qp(-1e-7, 1e-7, "uint8", min_scale=4e-8)
    assert scale == up32(4e-8)
    assert zp == 2  # rint(1e-7 / 4e-8) = rint(2.5) = 2 (half even)
    assert qp(-1.0, 1.0, "int8", symmetric=True, min_scale=0.5) == (0.5, 0)
    assert qp(-1.0, 1.0, "int8", symmetric=True, min_scale=1e-9) == qp(-1.0, 1.0, "int8", symmetric=True)


def test_per_channel_matches_per_tensor():
    rmin = np.array([-1.0, 0.0, -0.5, 0.0])
    rmax = np.array([1.0, 2.0, 0.0, 0.0])
    for kw in [{}, {"symmetric": True}, {"restricted": True}, {"power_of_two": True}]:
        for qt in ("uint8", "int8"):
            scales, zps = compute_qparams(rmin, rmax, qt, **kw)
            assert scales.shape == zps.shape == (4,)
            for i in range(4):
                assert (scales[i], zps[i]) == qp(rmin[i], rmax[i], qt, **kw)


def test_value_range_per_channel():
    w = np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 10
    lo, hi = value_range(w, axis=0)
    np.testing.assert_array_equal(lo, [-10, 2]) and np.testing.assert_array_equal(hi, [1, 13])
    lo, hi = value_range(w, axis=-1)
    np.testing.assert_array_equal(lo, [-10, -9, -8, -7])
    assert value_range(w) == (-10, 13)
    assert value_range(np.zeros((0,))) == (0, 0)


def test_round_half_even_and_saturation():
    np.testing.assert_array_equal(quantize([0.5, 1.5, 2.5, -0.5, -1.5], 1.0, 0, "int8"), [0, 2, 2, 0, -2])
    np.testing.assert_array_equal(quantize([1e9, -1e9], 0.1, 3, "uint8"), [255, 0])
    np.testing.assert_array_equal(quantize([1e20, -1e20, 2.0**31], 1.0, 0, "int32"),
                                  [INT32_MAX, -(2**31), INT32_MAX])
    assert quantize([1e20], 1.0, 0, "int32").dtype == np.int32


def test_bias_qparams():
    scale, zp = bias_qparams(0.05, [1e-3, 2e-3])
    np.testing.assert_array_equal(scale, fit_scale([5e-5, 1e-4]))
    np.testing.assert_array_equal(zp, [0, 0])
    assert bias_qparams(1e-30, 1e-30)[0] == np.finfo(np.float32).tiny
    need = bias_min_scale([5.0, 0.0])
    assert np.all(np.abs(5.0 / need[0]) <= INT32_MAX) and need[1] == np.finfo(np.float32).tiny


# -- properties ---------------------------------------------------------------------------------
finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)
modes = st.fixed_dictionaries({
    "qt": st.sampled_from(TYPES),
    "symmetric": st.booleans(),
    "restricted": st.booleans(),
    "reduce_range": st.booleans(),
    "power_of_two": st.booleans(),
    "scale_type": st.sampled_from(["float32", "float16"]),
    "minimum_real_range": st.sampled_from([None, 1e-4]),
})


def _scale_type_ok(rmin, rmax, m):
    # float16 scales cap at 65504: ranges wider than 65504 * levels cannot be covered
    return m["scale_type"] == "float32" or max(abs(rmin), abs(rmax)) < 1e3


@PROPS
@given(finite, finite, modes)
def test_range_round_trips_within_half_a_step(a, b, m):
    rmin, rmax = min(a, b), max(a, b)
    if not _scale_type_ok(rmin, rmax, m):
        return
    qt = m.pop("qt")
    scale, zp = compute_qparams(rmin, rmax, qt, **m)
    lo, hi = prepare_range(rmin, rmax, m["minimum_real_range"])
    for r in (float(lo), float(hi)):
        back = float(dequantize(quantize(r, scale, zp, qt), scale, zp))
        assert abs(back - r) <= 0.5 * float(scale) * (1 + 1e-6) + 1e-6 * abs(r), (r, back, scale, zp)
    if m["symmetric"]:
        back = float(dequantize(quantize(-hi if hi >= -lo else lo, scale, zp, qt), scale, zp))
        assert abs(back - (-max(hi, -lo))) <= 0.5 * float(scale) * (1 + 1e-6) + 1e-6 * max(hi, -lo)


@PROPS
@given(finite, finite, modes)
def test_zero_exact_zero_point_in_range_scale_valid(a, b, m):
    rmin, rmax = min(a, b), max(a, b)
    qt = qtype(m.pop("qt"))
    scale, zp = compute_qparams(rmin, rmax, qt, **m)
    assert zp.dtype == np.int64 and qt.qmin <= int(zp) <= qt.qmax
    assert float(dequantize(quantize(0.0, scale, zp, qt), scale, zp)) == 0.0
    dt = np.float16 if m["scale_type"] == "float16" else np.float32
    assert np.isfinite(scale) and scale >= np.finfo(dt).tiny and float(dt(scale)) == float(scale)
    if (float(scale), int(zp)) == (1.0, 0):   # degenerate (or a legitimate scale 1 with zero point 0)
        return
    if m["symmetric"]:
        assert int(zp) == (0 if qt.signed else midpoint(*qt.limits(True, m["reduce_range"])))
    elif m["restricted"] and not qt.signed:
        assert int(zp) == (0 if min(rmin, 0.0) >= 0 else midpoint(*qt.limits(False, m["reduce_range"])))
    if m["power_of_two"] and scale < 65504:
        assert np.log2(float(scale)) == np.round(np.log2(float(scale)))


@PROPS
@given(st.lists(st.floats(-1e12, 1e12, allow_nan=False, width=64), min_size=1, max_size=20),
       st.floats(1e-12, 1e3, allow_nan=False), st.integers(-(2**31), 2**31 - 1))
def test_int32_saturates_without_wraparound(values, scale, zp):
    q = quantize(values, scale, zp, "int32")
    assert q.dtype == np.int32
    exact = np.clip(np.rint(np.asarray(values) / scale) + zp, -(2**31), 2**31 - 1)
    np.testing.assert_array_equal(q.astype(np.float64), exact)
    assert np.all(np.sign(q.astype(np.float64) - zp) * np.sign(values) >= 0)  # no sign flip


@PROPS
@given(st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=30), st.sampled_from(TYPES))
def test_values_inside_range_round_trip(values, qt):
    v = np.asarray(values, np.float64)
    scale, zp = compute_qparams(v.min(), v.max(), qt)
    back = dequantize(quantize(v, scale, zp, qt), scale, zp)
    assert np.all(np.abs(back - v) <= 0.5 * scale * (1 + 1e-6) + 1e-6 * np.abs(v))


@PROPS
@given(finite, st.sampled_from(TYPES), st.booleans())
def test_saturation(x, qt, symmetric):
    t = qtype(qt)
    scale, zp = compute_qparams(-1.0, 1.0, t, symmetric=symmetric)
    q = int(quantize(x, scale, zp, t))
    assert t.qmin <= q <= t.qmax
    if x > 2.0:
        assert q == t.qmax
    if x < -2.0:
        assert q == t.qmin


@PROPS
@given(st.floats(1e-30, 1e30), st.sampled_from(["float32", "float16"]))
def test_fit_scale_rounds_up(s, scale_type):
    dt = np.dtype(scale_type).type
    fitted = float(fit_scale(s, scale_type))
    info = np.finfo(dt)
    assert float(dt(fitted)) == fitted and float(info.tiny) <= fitted <= float(info.max)
    if float(info.tiny) <= s <= float(info.max):
        assert fitted >= s and float(np.nextafter(dt(fitted), dt(0))) < s


@pytest.mark.parametrize("qt", TYPES)
def test_all_zero_range_is_usable(qt):
    scale, zp = qp(0.0, 0.0, qt)
    assert scale == 1.0 and zp == 0


@pytest.mark.parametrize("qt, axis", [("int8", None), ("uint8", None), ("int8", 0), ("uint16", 1), ("int16", None)])
def test_quantize_and_dequantize_match_onnxruntime_bit_for_bit(qt, axis):
    """float32 arithmetic like onnxruntime's QuantizeLinear/DequantizeLinear, also at rounding ties."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    channels = 6 if axis is not None else 1
    scale = (rng.random(channels) * 0.02 + 1e-3).astype(np.float32)
    x = (rng.standard_normal((6, 6, 5)) * 2).astype(np.float32)
    ties = np.arange(-90, 90).astype(np.float32).reshape(6, 6, 5) + 0.5   # k + 0.5 steps
    x[::2] = (ties * (scale.reshape(-1, 1, 1) if axis == 0 else scale[0]))[::2]
    limits = qtype(qt)
    zp = rng.integers(limits.qmin // 2, limits.qmax // 2 + 1, channels).astype(limits.storage)
    attrs = {"axis": axis} if axis is not None else {}
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], **attrs),
         helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], **attrs)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("q", helper.np_dtype_to_tensor_dtype(np.dtype(limits.storage)), None),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(scale if axis is not None else scale[:1].reshape(()), "s"),
         numpy_helper.from_array(zp if axis is not None else zp[:1].reshape(()), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    q_ort, y_ort = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    q = quantize(x, scale.astype(np.float64), zp, qt, axis)
    np.testing.assert_array_equal(q, q_ort)
    np.testing.assert_array_equal(dequantize(q, scale.astype(np.float64), zp, axis), y_ort)
