"""Softmax inputs: calibrate measures the row maxima; compute-qparams clips below the smallest one and keeps them all."""
import numpy as np
import onnx
import pytest

from qpasses.api import quantize
from qpasses.calibration.ranges import outward
from qpasses.calibration.softmax import NEGLIGIBLE, ROW_MAX_SUFFIX
from qpasses.core.pipeline import PassManager
from qpasses.core.verify import check_onnx
from qpasses.evaluation.evaluate import snr_db
from qpasses.testing import model_from_text, parse, run, run_passes

# attention-like scores plus an additive padding mask (0 or -10000 per key)
MASKED = """
g (float[1, 8, 16] scores, float[1, 1, 16] mask) => (float[1, 8, 16] y) {
    masked = Add(scores, mask)
    y = Softmax <axis = -1> (masked)
}
"""


def _feeds(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        mask = np.zeros((1, 1, 16), np.float32)
        mask[..., rng.integers(4, 16):] = -10000.0
        out.append({"scores": (rng.standard_normal((1, 8, 16)) * 3).astype(np.float32), "mask": mask})
    return out


# Softmax (and Add) stay float by default; these tests are about how a Softmax input is quantized
ALL = {"op_types_to_quantize": "all"}
CONFIG = {"activation_type": "uint8", "weight_type": "int8", "per_channel": False,
          "calibration": {"method": "minmax"}, **ALL}


# percentile 99.98 keeps every one of these few row maxima, so the calibrated ranges are their extremes
CALIBRATE = "annotate-types,calibrate{method=percentile}"


def _calibrated(text=MASKED, opset=17, feeds=None):
    model = model_from_text(text, opset=opset)
    run_passes(CALIBRATE, model, ALL, data=feeds or _feeds(8))
    return model


def test_row_maximum_measured_and_graph_untouched():
    model = model_from_text(MASKED)
    before = onnx.printer.to_text(model.to_proto().graph)
    feeds = _feeds(8)
    run_passes(CALIBRATE, model, ALL, data=feeds)
    assert onnx.printer.to_text(model.to_proto().graph) == before   # the probe node is gone again
    check_onnx(model)
    lo, hi = model.ranges["masked" + ROW_MAX_SUFFIX]
    row_max = [(f["scores"] + f["mask"]).max(axis=-1) for f in feeds]
    want = outward(float(min(r.min() for r in row_max)), float(max(r.max() for r in row_max)))
    assert (lo, hi) == pytest.approx(want, abs=1e-6)
    assert model.ranges["masked"][0] < -9000   # the tensor's own range still has the mask


def test_lower_end_clipped_and_explained():
    model = _calibrated()
    PassManager("compute-qparams").run(model)
    row_min = model.ranges["masked" + ROW_MAX_SUFFIX][0]
    tq = model.quant["masked"]
    # [row_min - 20, max] on a u8 grid (zero inside), instead of [-10000, max]
    expected = (model.ranges["masked"][1] - (row_min - NEGLIGIBLE)) / 255
    assert tq.scale[0] == pytest.approx(expected, rel=0.02)
    assert any("read only by Softmax" in why for why in tq.why)


def test_quantized_softmax_far_closer_to_float():
    feeds, evals = _feeds(16), _feeds(8, seed=1)
    proto = parse(MASKED)
    q = quantize(model_from_text(MASKED), feeds, config=CONFIG).to_proto()
    check_onnx(q)
    ref = np.concatenate([run(proto, f)[0].ravel() for f in evals])
    got = np.concatenate([run(q, f)[0].ravel() for f in evals])
    assert snr_db(ref, got) > 30   # about 3 dB with the grid spread over the mask


def test_not_applied_when_another_op_reads_the_tensor():
    text = MASKED.replace("=> (float[1, 8, 16] y)", "=> (float[1, 8, 16] y, float[1, 8, 16] z)") \
                 .replace("y = Softmax <axis = -1> (masked)", "y = Softmax <axis = -1> (masked)\n    z = Relu(masked)")
    model = _calibrated(text)
    assert "masked" + ROW_MAX_SUFFIX not in model.ranges
    PassManager("compute-qparams").run(model)
    assert model.quant["masked"].scale[0] > 30   # the full [-10000, max] range


@pytest.mark.parametrize("opset", [11, 18])
def test_old_softmax_axes_and_reduce_axes_input(opset):
    text = MASKED.replace("Softmax <axis = -1>", "Softmax <axis = 2>")
    feeds = _feeds(8)
    model = _calibrated(text, opset=opset, feeds=feeds)
    lo, _ = model.ranges["masked" + ROW_MAX_SUFFIX]
    assert lo == pytest.approx(min((f["scores"] + f["mask"]).max(axis=-1).min() for f in feeds), abs=1e-3)


WIDE = """
g (float[1, 4, 2000] logits) => (float[1, 4, 2000] y) {
    y = Softmax <axis = -1> (logits)
}
"""


def _logits(n, seed=0):
    """Rows of 2000 small logits with one clear winner each: a percentile of the tensor cuts the winners."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal((1, 4, 2000)).astype(np.float32)
        x[0, np.arange(4), rng.integers(0, 2000, 4)] = rng.uniform(8, 12, 4)
        out.append({"logits": x})
    return out


def test_upper_end_raised_to_the_row_maxima():
    model = model_from_text(WIDE)
    run_passes("annotate-types,calibrate{method=percentile,percentile=99.9},compute-qparams", model, ALL, data=_logits(16))
    top = model.ranges["logits" + ROW_MAX_SUFFIX][1]
    assert model.ranges["logits"][1] < 6 < 8 < top      # the percentile cut every winner
    tq = model.quant["logits"]
    rmax = (255 - tq.zero_point[0]) * tq.scale[0]
    assert rmax == pytest.approx(top, rel=0.01)
    assert any("row maxima reach it" in why for why in tq.why)


def test_upper_end_keeps_the_winners_in_the_output():
    feeds, evals = _logits(16), _logits(8, seed=1)
    config = {"calibration": {"method": "percentile", "percentile": 99.9}, **ALL}
    q = quantize(model_from_text(WIDE), feeds, config=config).to_proto()
    check_onnx(q)
    ref = np.concatenate([run(parse(WIDE), f)[0].ravel() for f in evals])
    got = np.concatenate([run(q, f)[0].ravel() for f in evals])
    assert snr_db(ref, got) > 25
