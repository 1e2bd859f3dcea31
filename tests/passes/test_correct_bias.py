"""correct-bias: the mean output shift of quantized weights leaves the bias (A16W8 depthwise, Gemm)."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from qpasses.api import run_pipeline
from qpasses.core.context import RunContext
from qpasses.core.pipeline import QUANTIZE_PIPELINE
from qpasses.core.verify import check_onnx
from qpasses.evaluation.evaluate import snr_db
from qpasses.ir.model import from_proto
from qpasses.quant.qparams import dequantize, quantize as quantize_values
from qpasses.testing import model_from_text, parse, run, run_passes

# ppocr_v4_rec's pattern: 3x3 depthwise filters whose taps sum to about 0, on inputs far from 0
DEPTHWISE = """
g (float[1, 2, 8, 8] x) => (float[1, 2, 8, 8] y)
<float[2, 1, 3, 3] w = {0.44, -2.08, 0.41, -1.91, -3.92, -1.62, 1.49, 5.98, 1.22,
                        0.035, -0.058, 0.016, -0.0017, 0.62, 0.031, -0.021, 0.37, -0.136},
 float[2] b = {1.5, -0.7}>
{
    y = Conv <group = 2, pads = [1, 1, 1, 1]> (x, w, b)
}
"""
GEMM = """
g (float[4, 16] x) => (float[4, 3] y)
<float[3, 16] w = {0.9, -0.8, 0.05, 0.02, -0.03, 0.01, 0.7, -0.6, 0.04, 0.03, -0.02, 0.015, 0.5, -0.45, 0.02, 0.01,
                   0.3, 0.31, -0.3, -0.29, 0.002, 0.003, 0.004, 0.001, 0.6, -0.55, 0.02, 0.01, -0.01, 0.3, 0.2, 0.1,
                   -0.7, 0.002, 0.69, 0.001, 0.0003, 0.0002, 0.0001, 0.5, -0.49, 0.03, 0.02, 0.01, 0.004, -0.2, 0.19, 0.3},
 float[3] b = {0.1, 0.2, 0.3}>
{
    y = Gemm <transB = 1> (x, w, b)
}
"""
A16W8 = {"activation_type": "uint16", "weight_type": "int8", "per_channel": False}
NO_SELECT = QUANTIZE_PIPELINE.replace("round-weights,", "")   # it leaves no weight error to correct
SCORED = NO_SELECT.replace("select-by-snr", "select-by-snr{bias_correction=true}")
WITHOUT = NO_SELECT.replace("correct-bias,", "")


def _feeds(shape, n, seed=0, offset=(20.0, -30.0)):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 4:
            x += np.asarray(offset, np.float32).reshape(1, 2, 1, 1)
        else:
            x += 10.0
        out.append({"x": x})
    return out


def _snr(text, config, passes, feeds, evals):
    """(output SNR, quantized model, findings) of ``text`` quantized by ``passes``."""
    ctx = RunContext(config, feeds)
    q, _ = run_pipeline(model_from_text(text), passes, ctx=ctx)
    proto = q.to_proto()
    check_onnx(proto)
    ref = np.concatenate([run(parse(text), f)[0].ravel() for f in evals])
    got = np.concatenate([run(proto, f)[0].ravel() for f in evals])
    return snr_db(ref, got), q, ctx.findings.as_dict()


def test_depthwise_a16w8_recovers_the_dc_error():
    feeds, evals = _feeds((1, 2, 8, 8), 8), _feeds((1, 2, 8, 8), 4, seed=1)
    before, _, _ = _snr(DEPTHWISE, A16W8, WITHOUT, feeds, evals)
    after, q, findings = _snr(DEPTHWISE, A16W8, NO_SELECT, feeds, evals)
    assert after > before + 5, (before, after)   # measured: 37.0 -> 43.5 dB
    assert findings["correct-bias"]["layers"] == 1
    assert q.decisions["bias_correction"] == {"by": "correct-bias", "applied": True}
    assert any("correct-bias" in why for why in q.quant["b"].why)


def test_shift_is_the_mean_of_the_layer_on_the_weight_error():
    feeds = _feeds((1, 2, 8, 8), 8)
    model = model_from_text(DEPTHWISE)
    run_passes("annotate-types,calibrate,compute-qparams", model, A16W8, feeds)
    w = np.asarray(model.tensors()["w"].values, np.float64)
    b = np.asarray(model.tensors()["b"].values, np.float64)
    tq = model.quant["w"]
    error = dequantize(quantize_values(w, tq.scale, tq.zero_point, tq.qtype), tq.scale, tq.zero_point) - w
    # conv with 'same' padding, per channel (group = 2), averaged over samples and pixels
    shifts = []
    for f in feeds:
        x = np.pad(f["x"][0].astype(np.float64), ((0, 0), (1, 1), (1, 1)))
        out = np.zeros((2, 8, 8))
        for c in range(2):
            for i in range(3):
                for j in range(3):
                    out[c] += error[c, 0, i, j] * x[c, i:i + 8, j:j + 8]
        shifts.append(out.mean(axis=(1, 2)))
    run_passes("correct-bias", model, A16W8, feeds)
    corrected = np.asarray(model.tensors()["b"].values, np.float64)
    np.testing.assert_allclose(corrected, b - np.mean(shifts, axis=0), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(model.tensors()["w"].values, np.float64), w)   # weights kept


def test_gemm_with_transposed_weight():
    feeds, evals = _feeds((4, 16), 8), _feeds((4, 16), 4, seed=1)
    before, _, _ = _snr(GEMM, A16W8, WITHOUT, feeds, evals)
    after, q, findings = _snr(GEMM, A16W8, NO_SELECT, feeds, evals)
    assert findings["correct-bias"]["layers"] == 1
    assert after > before + 6, (before, after)


def test_8_bit_inputs_are_left_alone_by_default():
    feeds = _feeds((1, 2, 8, 8), 4)
    _, q, findings = _snr(DEPTHWISE, {"activation_type": "uint8", "weight_type": "int8"}, QUANTIZE_PIPELINE, feeds, feeds)
    assert "correct-bias" not in findings and "bias_correction" not in q.decisions
    assert not any("correct-bias" in why for why in q.quant["b"].why)


def test_depthwise_a8w8_improves_when_asked():
    feeds, evals = _feeds((1, 2, 8, 8), 8), _feeds((1, 2, 8, 8), 4, seed=1)
    config = {"activation_type": "uint8", "weight_type": "int8", "per_channel": False}
    before, _, _ = _snr(DEPTHWISE, config, WITHOUT, feeds, evals)
    after, _, findings = _snr(DEPTHWISE, config, NO_SELECT.replace("correct-bias", "correct-bias{activation_bits=8}"),
                              feeds, evals)
    assert findings["correct-bias"]["layers"] == 1
    assert after > before + 1, (before, after)


@pytest.mark.parametrize("bits, layers", [(8, 1), (16, 0)])
def test_activation_bits_option(bits, layers):
    feeds = _feeds((1, 2, 8, 8), 4)
    passes = NO_SELECT.replace("correct-bias", f"correct-bias{{activation_bits={bits}}}")
    _, _, findings = _snr(DEPTHWISE, {"activation_type": "uint8", "weight_type": "int8"}, passes, feeds, feeds)
    assert findings.get("correct-bias", {}).get("layers", 0) == layers


def test_one_shot_data_is_skipped_with_a_reason():
    feeds = _feeds((1, 2, 8, 8), 4)
    model = model_from_text(DEPTHWISE)
    run_passes("annotate-types,calibrate,compute-qparams", model, A16W8, feeds)
    before = np.asarray(model.tensors()["b"].values).copy()
    ctx = RunContext(A16W8, iter([]))   # a generator that calibrate already used up
    run_passes("correct-bias", model, ctx=ctx)
    np.testing.assert_array_equal(np.asarray(model.tensors()["b"].values), before)
    assert "0 calibration sample(s) could be read again" in ctx.findings.as_dict()["correct-bias"]["skipped"]


def test_stands_aside_above_max_nodes():
    feeds = _feeds((1, 2, 8, 8), 4)
    passes = NO_SELECT.replace("correct-bias", "correct-bias{max_nodes=0}")
    _, _, findings = _snr(DEPTHWISE, A16W8, passes, feeds, feeds)
    assert findings["correct-bias"]["skipped"] == "1 nodes is over max_nodes=0"


def _conv(w: np.ndarray, attrs: dict, op: str = "Conv", x_shape=(1, 4, 9, 9)):
    c_out = w.shape[0] if op == "Conv" else w.shape[1] * attrs.get("group", 1)
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "w", "b"], ["y"], **attrs)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.zeros(c_out, np.float32), "b")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 10
    return proto


@pytest.mark.parametrize("op, attrs, w_shape, x_shape", [
    ("Conv", {"strides": [2, 2], "pads": [1, 0, 1, 0]}, (12, 4, 3, 3), (1, 4, 9, 9)),
    ("Conv", {"group": 2, "dilations": [2, 2], "pads": [2, 2, 2, 2]}, (24, 2, 3, 3), (1, 4, 9, 9)),
    ("Conv", {"group": 4, "pads": [1, 1, 1, 1]}, (4, 1, 3, 3), (1, 4, 9, 9)),                  # depthwise
    ("Conv", {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (6, 4, 4, 4), (2, 4, 10, 9)),      # uneven pads, batch 2
    ("Conv", {"auto_pad": "SAME_LOWER", "strides": [2, 1]}, (6, 4, 4, 3), (1, 4, 10, 9)),
    ("Conv", {"auto_pad": "VALID", "strides": [3, 2]}, (5, 4, 2, 3), (1, 4, 10, 9)),
    ("Conv", {"strides": [2], "pads": [2, 1], "dilations": [2]}, (7, 4, 3), (1, 4, 17)),       # 1-D
    ("Conv", {"pads": [1, 0, 1, 0, 1, 1]}, (3, 4, 3, 2, 3), (1, 4, 5, 6, 4)),                    # 3-D
    ("ConvTranspose", {"strides": [2, 2], "pads": [1, 1, 0, 0], "output_padding": [1, 0]}, (4, 3, 3, 3), (1, 4, 9, 9)),
    ("ConvTranspose", {"group": 2, "dilations": [2, 1], "pads": [0, 1, 2, 1]}, (4, 5, 3, 3), (1, 4, 9, 9)),
])
def test_shift_matches_the_layer_run_on_its_weight_error(op, attrs, w_shape, x_shape):
    rng = np.random.default_rng(3)
    w = rng.standard_normal(w_shape).astype(np.float32)
    model = from_proto(_conv(w, attrs, op, x_shape))
    feeds = [{"x": (rng.standard_normal(x_shape) + 3).astype(np.float32)} for _ in range(4)]
    config = {"activation_type": "uint16", "weight_type": "int8", "per_channel": False}
    run_passes("annotate-types,calibrate,compute-qparams", model, config, feeds)
    tq = model.quant["w"]
    error = (dequantize(quantize_values(w, tq.scale, tq.zero_point, tq.qtype), tq.scale, tq.zero_point)
             - w).astype(np.float32)
    spatial = tuple(range(2, len(x_shape)))
    expected = np.mean([run(_conv(error, attrs, op, x_shape), f)[0].mean(axis=(0, *spatial)) for f in feeds], axis=0)
    ctx = RunContext(config, feeds)
    run_passes("correct-bias{significance=0}", model, ctx=ctx)
    assert ctx.findings.as_dict()["correct-bias"]["layers"] == 1
    np.testing.assert_allclose(model.tensors()["b"].values, -expected, rtol=1e-3, atol=1e-6)


def test_conv_transpose_with_auto_pad_is_left_alone_and_feeds_of_other_shapes_are_skipped():
    rng = np.random.default_rng(4)
    config = {"activation_type": "uint16", "weight_type": "int8", "per_channel": False}
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    model = from_proto(_conv(w, {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, "ConvTranspose"))
    ctx = RunContext(config, [{"x": rng.standard_normal((1, 4, 9, 9)).astype(np.float32)} for _ in range(4)])
    run_passes("annotate-types,calibrate,compute-qparams,correct-bias", model, ctx=ctx)
    assert ctx.findings.as_dict()["correct-bias"] == {"skipped": "no layer with known shapes and padding to correct"}
    proto = _conv(rng.standard_normal((6, 4, 3, 3)).astype(np.float32), {"pads": [1, 1, 1, 1]})
    proto.graph.input[0].type.tensor_type.shape.dim[3].dim_param = "width"
    model = from_proto(proto)
    ctx = RunContext(config, [{"x": rng.standard_normal((1, 4, 9, 9 + (i % 2))).astype(np.float32)} for i in range(6)])
    run_passes("annotate-types,calibrate,compute-qparams,correct-bias", model, ctx=ctx)
    assert ctx.findings.as_dict()["correct-bias"]["samples"] == 3
    assert ctx.findings.as_dict()["correct-bias"]["samples_of_other_shapes"] == 3


def test_select_by_snr_keeps_it_only_when_it_scores_higher():
    feeds, evals = _feeds((1, 2, 8, 8), 16), _feeds((1, 2, 8, 8), 4, seed=1)
    snr, q, findings = _snr(DEPTHWISE, A16W8, SCORED, feeds, evals)
    decision = findings["select-by-snr"]["bias_correction"]
    assert decision["applied"] and decision["gain_db"] > 0
    assert findings["correct-bias"]["applied_by"] == "select-by-snr"
    assert q.decisions["bias_correction"] == {"by": "select-by-snr", "applied": True, "gain_db": decision["gain_db"]}
    assert sum("correct-bias" in why for why in q.quant["b"].why) == 1   # applied once, not again
    forced, _, _ = _snr(DEPTHWISE, A16W8, NO_SELECT, feeds, evals)
    assert snr == pytest.approx(forced)


def test_select_by_snr_refuses_it_when_it_scores_lower(monkeypatch):
    import qpasses.passes.correct_bias as correct_bias
    real = correct_bias.Target.shift
    monkeypatch.setattr(correct_bias.Target, "shift", lambda self, mean: -50 * real(self, mean))  # a wrong shift
    feeds = _feeds((1, 2, 8, 8), 16)
    _, q, findings = _snr(DEPTHWISE, A16W8, SCORED, feeds, feeds)
    assert not findings["select-by-snr"]["bias_correction"]["applied"]
    assert q.decisions["bias_correction"]["by"] == "select-by-snr" and not q.decisions["bias_correction"]["applied"]
    assert "scored the model" in findings["correct-bias"]["skipped"]
    assert not any("correct-bias" in why for why in q.quant["b"].why)
