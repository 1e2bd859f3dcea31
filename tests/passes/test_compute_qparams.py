"""compute-qparams: activations, weights, biases, shares, converts, config options, unquantized."""
import numpy as np
import onnx.printer
import pytest

from qpasses.config.quant_config import CalibrationConfig, QuantConfig
from qpasses.core.context import RunContext
from qpasses.core.pipeline import PassManager
from qpasses.core.verify import check_onnx
from qpasses.errors import PassFailure, PreconditionError
from qpasses.ir.annotations import Convert, QuantTable, TensorQuant
from qpasses.ir.decisions import float_reasons
from qpasses.ir.model import from_proto
from qpasses.passes.compute_qparams import ComputeQParams
from qpasses.quant.qparams import compute_qparams, fit_scale
from qpasses.testing import model_from_text

CONV = """
g (float[1,2,4,4] x) => (float[1,2,4,4] y)
  <float[2,2,1,1] w = {0.5, -0.25, 0.125, 1.0}, float[2] b = {0.1, -0.2},
   int64[4] shape = {1, 2, 16, 1}, int64[4] shape2 = {1, 2, 4, 4}>
{
  c = Conv(x, w, b)
  r = Reshape(c, shape)
  y = Reshape(r, shape2)
}
"""

GEMM = """
g (float[3,4] x) => (float[3,2] y) <float[4,2] w = {0.5, -0.25, 0.125, 1.0, 2.0, -1.0, 0.3, 0.4}, float[1,2] b = {0.1, -0.2}>
{
  y = Gemm(x, w, b)
}
"""


def conv_model(per_channel=False, weight_type="int8", symmetric=True):
    m = model_from_text(CONV)
    m.facts |= {"calibrated", "types-annotated"}
    m.ranges = {"x": (-1.0, 3.0), "c": (-2.0, 5.0), "r": (-2.0, 5.0), "y": (-2.0, 5.0)}
    m.quant["x"] = TensorQuant("uint8")
    m.quant["w"] = TensorQuant(weight_type, role="weight", symmetric=symmetric, axis=0 if per_channel else None)
    m.quant["b"] = TensorQuant("int32", role="bias", symmetric=True, derived_from=["x", "w"])
    m.quant["c"] = TensorQuant("uint8")
    m.quant["y"] = TensorQuant("uint8", shares="r")
    m.quant["r"] = TensorQuant("uint8", shares="c")
    return m


def run(m, config=None):
    return ComputeQParams().run(m, RunContext(config))


def qparams(m, name):
    return m.quant[name].scale, m.quant[name].zero_point


def expected(rmin, rmax, qt, **kw):
    s, z = compute_qparams(rmin, rmax, qt, **kw)
    return [float(v) for v in np.ravel(s)], [int(v) for v in np.ravel(z)]


def test_conv_per_tensor():
    m = conv_model()
    result = run(m)
    assert result.modified
    assert qparams(m, "x") == expected(-1.0, 3.0, "uint8")
    assert qparams(m, "c") == expected(-2.0, 5.0, "uint8")
    assert qparams(m, "w") == expected(-0.25, 1.0, "int8", symmetric=True)
    assert m.quant["w"].scale == [float(np.float32(1.0 / 127))] and m.quant["w"].zero_point == [0]
    assert m.quant["b"].scale == [float(fit_scale(m.quant["x"].scale[0] * m.quant["w"].scale[0]))]
    assert m.quant["b"].zero_point == [0] and m.quant["b"].axis is None
    assert m.quant["y"].scale == m.quant["r"].scale == m.quant["c"].scale
    assert f"compute-qparams: range [-1, 3] from calibration ({CalibrationConfig.method}); uint8 asymmetric" in m.quant["x"].why
    assert any("from the weight's values" in w for w in m.quant["w"].why)
    assert m.quant["b"].why == ["compute-qparams: scale = scale('x') * scale('w')"]
    assert m.quant["y"].why == ["compute-qparams: qparams shared with 'r'"]
    assert result.stats == {"changed": 6, "activation": 2, "weight": 1, "bias": 1, "shared": 2,
                            "converts": 0, "unquantized": 0}


def test_idempotent_and_graph_untouched():
    m = conv_model(per_channel=True)
    before = onnx.printer.to_text(m.to_proto().graph)
    run(m)
    table = m.quant.to_json()
    again = run(m)
    assert again.modified is False and again.stats["changed"] == 0
    assert m.quant.to_json() == table
    after = m.to_proto()
    assert onnx.printer.to_text(after.graph) == before
    check_onnx(after)
    assert from_proto(after).quant == m.quant  # the table survives export


def test_per_channel_weight_and_bias():
    m = conv_model(per_channel=True)
    run(m)
    assert qparams(m, "w") == expected([-0.25, 0.125], [0.5, 1.0], "int8", symmetric=True)
    assert len(m.quant["b"].scale) == 2 and m.quant["b"].axis == 0
    np.testing.assert_array_equal(m.quant["b"].scale,
                                  fit_scale(m.quant["x"].scale[0] * np.asarray(m.quant["w"].scale)))
    assert any("per channel (axis 0, 2 channels)" in w for w in m.quant["w"].why)


def test_uint8_asymmetric_weight():
    m = conv_model(weight_type="uint8", symmetric=False)
    run(m)
    assert qparams(m, "w") == expected(-0.25, 1.0, "uint8")


def test_gemm_bias_1xn_per_channel():
    m = model_from_text(GEMM)
    m.facts |= {"calibrated", "types-annotated"}
    m.ranges = {"x": (-1.0, 1.0), "y": (-3.0, 3.0)}
    m.quant["x"] = TensorQuant("uint8")
    m.quant["w"] = TensorQuant("int8", role="weight", symmetric=True, axis=1)
    m.quant["b"] = TensorQuant("int32", role="bias", derived_from=["x", "w"])
    run(m)
    assert qparams(m, "w") == expected([-0.25, -1.0], [2.0, 1.0], "int8", symmetric=True)
    assert m.quant["b"].axis == 1 and len(m.quant["b"].scale) == 2


def test_activation_without_range_is_unquantized_with_dependents():
    m = conv_model()
    del m.ranges["x"], m.ranges["c"]
    result = run(m)
    assert "x" not in m.quant and "b" not in m.quant and "c" not in m.quant
    assert "r" not in m.quant and "y" not in m.quant and "w" in m.quant
    report = {name: u["reason"] for name, u in float_reasons(m).items()}
    assert report["x"] == "no calibrated range"
    assert report["b"] == "derived from 'x', which is not quantized"
    assert report["r"] == "shares qparams with 'c', which is not quantized"
    assert list(float_reasons(m)) == sorted(report)
    assert {u["pass"] for u in float_reasons(m).values()} == {"compute-qparams"}
    assert result.stats["unquantized"] == 5
    assert run(m).modified is False


def test_non_finite_range_is_unquantized():
    m = conv_model()
    m.ranges["c"] = (-np.inf, 5.0)
    run(m)
    assert "c" not in m.quant
    assert "not finite" in float_reasons(m)["c"]["reason"]


def test_entry_range_overrides_calibration():
    m = conv_model()
    m.quant["x"].rmin, m.quant["x"].rmax = 0.0, 6.0
    m.quant["c"].rmax = 10.0
    run(m)
    assert qparams(m, "x") == expected(0.0, 6.0, "uint8")
    assert qparams(m, "c") == expected(-2.0, 10.0, "uint8")
    assert "the entry's rmin/rmax" in m.quant["x"].why[-1]


@pytest.mark.parametrize("method, qt, source", [("percentile", "uint16", "observed"), ("entropy", "int16", "observed"),
                                                ("percentile", "uint8", "ranges"), ("minmax", "uint16", "ranges")])
def test_wide_types_use_observed_range_when_calibration_clips(method, qt, source):
    m = conv_model()
    m.observed = {"c": (-20.0, 50.0)}
    m.quant["c"].qtype = qt
    run(m, QuantConfig(calibration=CalibrationConfig(method=method)))
    rng = (-20.0, 50.0) if source == "observed" else (-2.0, 5.0)
    assert qparams(m, "c") == expected(*rng, qt)
    assert ("observed min/max" in m.quant["c"].why[-1]) == (source == "observed")


def test_config_pow2_fp16_minimum_range_and_restricted():
    config = QuantConfig(calibration=CalibrationConfig(method="pow2"), scale_type="float16", minimum_real_range=1e-3)
    m = conv_model()
    m.quant["c"].restricted = True
    m.ranges["x"] = (0.0, 1e-6)
    run(m, config)
    opts = {"power_of_two": True, "scale_type": "float16", "minimum_real_range": 1e-3}
    assert qparams(m, "x") == expected(0.0, 1e-6, "uint8", **opts)
    assert qparams(m, "c") == expected(-2.0, 5.0, "uint8", restricted=True, **opts)
    assert m.quant["c"].zero_point == [128]
    for name in ("x", "c", "w"):
        s = m.quant[name].scale[0]
        assert np.log2(s) == np.round(np.log2(s)) and np.float16(s) == s
    assert "uint8 restricted, pow2, float16 scale, minimum range 0.001" in m.quant["c"].why[-1]


def test_fixed_entries_are_kept_and_used():
    m = conv_model()
    m.quant["x"] = TensorQuant("uint8", scale=[0.5], zero_point=[10], fixed=True, why=["override"])
    run(m)
    assert qparams(m, "x") == ([0.5], [10]) and m.quant["x"].why == ["override"]
    assert m.quant["b"].scale == [float(fit_scale(0.5 * m.quant["w"].scale[0]))]


def test_convert_filled():
    m = conv_model()
    m.quant["c"].convert = Convert("uint16", ["Reshape_1"])
    m.quant["r"].convert = Convert("int8", ["Reshape_2"], symmetric=True)
    result = run(m)
    conv = m.quant["c"].convert
    assert (conv.scale, conv.zero_point) == expected(-2.0, 5.0, "uint16")
    conv = m.quant["r"].convert
    assert (conv.scale, conv.zero_point) == expected(-2.0, 5.0, "int8", symmetric=True)
    assert result.stats["converts"] == 2
    assert "convert to uint16 asymmetric" in m.quant["c"].why[-1]
    assert run(m).modified is False


def test_rerun_after_a_change_recomputes():
    m = conv_model()
    run(m)
    m.quant["w"] = m.quant["w"].with_qparams([1.0], [0], "someone raised it")
    result = run(m)
    assert result.modified and result.stats["changed"] == 1  # the weight (its bias never changed)
    assert m.quant["w"].why[-2:] == ["someone raised it", m.quant["w"].why[0]]
    assert qparams(m, "w") == expected(-0.25, 1.0, "int8", symmetric=True)


def test_shares_cycle_is_internal_error():
    m = conv_model()
    m.quant["c"].shares = "y"
    with pytest.raises(PassFailure, match="'shares' cycle"):
        PassManager([ComputeQParams()]).run(m)


def test_empty_table_is_noop():
    m = model_from_text(CONV)
    m.facts |= {"calibrated", "types-annotated"}
    result = run(m)
    assert result.modified is False and len(m.quant) == 0 and "float" not in m.decisions


def test_precondition():
    m = conv_model()
    m.facts = {"calibrated"}
    with pytest.raises(PreconditionError, match="types-annotated"):
        PassManager([ComputeQParams()]).run(m)
    m.facts = {"calibrated", "types-annotated"}
    PassManager([ComputeQParams()]).run(m)
    assert "qparams-computed" in m.facts


def test_table_json_round_trip():
    m = conv_model(per_channel=True)
    m.quant["c"].convert = Convert("uint16", ["Reshape_1"])
    run(m)
    assert QuantTable.from_json(m.quant.to_json()) == m.quant


def test_clipping_methods_keep_the_full_range_of_graph_outputs():
    """An entropy/percentile range clips the tail; on a graph output that shows directly in the
    result (entropy clipped a ShuffleNet softmax output from 0.52 to 0.065), so outputs use the
    observed range unless calibration.clip_graph_outputs."""
    def model(clip):
        m = model_from_text(GEMM)
        m.facts |= {"calibrated", "types-annotated"}
        m.ranges = {"x": (-1.0, 1.0), "y": (-1.0, 1.0)}
        m.observed = {"x": (-4.0, 4.0), "y": (-4.0, 4.0)}
        m.quant["x"], m.quant["y"] = TensorQuant("uint8"), TensorQuant("uint8")
        run(m, QuantConfig(calibration=CalibrationConfig(method="entropy", clip_graph_outputs=clip)))
        return m

    full, clipped = model(False), model(True)
    assert full.quant["y"].scale == expected(-4.0, 4.0, "uint8")[0] and "a graph output" in full.quant["y"].why[-1]
    assert clipped.quant["y"].scale == expected(-1.0, 1.0, "uint8")[0]
    assert full.quant["x"].scale == clipped.quant["x"].scale == expected(-1.0, 1.0, "uint8")[0]


MAXPOOL = """
g (float[1,1,4,4] x) => (float[1,1,2,2] y) {
  t = Sigmoid(x)
  p = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (t)
  y = Relu(p)
}
"""


def test_range_of_a_max_pooled_tensor_covers_the_pooled_values():
    """MaxPool keeps the top of its input: a percentile range of the input (ppocr_v2_cls: 8.5 of an
    observed 11.6) clips its output far more, so the input's range widens to the output's."""
    from qpasses.analysis.ranges import tensors_needing_ranges

    m = model_from_text(MAXPOOL)
    every_op = QuantConfig(op_types_to_quantize="all")    # the Sigmoid feeding the MaxPool stays float by default
    PassManager("annotate-types").run(m, RunContext(every_op))
    assert m.quant["p"].shares == "t" and "p" in tensors_needing_ranges(m)
    m.facts.add("calibrated")
    m.ranges = {"x": (-1.0, 1.0), "t": (0.0, 0.6), "p": (0.1, 0.9), "y": (0.1, 0.9)}
    run(m, every_op)
    assert m.quant["t"].scale == m.quant["p"].scale == expected(0.0, 0.9, "uint8")[0]
    assert "max-pooled 'p'" in m.quant["t"].why[-1]
