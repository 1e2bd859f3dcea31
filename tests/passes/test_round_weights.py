"""round-weights: GPTQ codes with the table's scales (layers with 16-bit inputs by default)."""
import numpy as np
import pytest

from qpasses.api import run_pipeline
from qpasses.core.context import RunContext
from qpasses.core.pipeline import QUANTIZE_PIPELINE
from qpasses.core.verify import check_onnx
from qpasses.evaluation.evaluate import snr_db
from qpasses.quant.qparams import quantize as quantize_values
from qpasses.quant import rounding
from qpasses.quant.rounding import Geometry, conv_geometry, input_rows, most_rows, round_codes, upper_inverse_cholesky
from qpasses.testing import model_from_text, parse, run, run_passes

WITH = QUANTIZE_PIPELINE
WITHOUT = WITH.replace("round-weights,", "")
A16W8 = {"activation_type": "uint16", "weight_type": "int8"}


def _weights(shape, seed):
    return ", ".join(f"{v:.4f}" for v in np.random.default_rng(seed).standard_normal(int(np.prod(shape))) * 0.3)


CONV = f"""
g (float[1, 8, 12, 12] x) => (float[1, 6, 12, 12] y)
<float[6, 8, 3, 3] w = {{{_weights((6, 8, 3, 3), 1)}}}, float[6] b = {{0.1, -0.2, 0.3, 0.0, 0.05, -0.1}}>
{{
    y = Conv <pads = [1, 1, 1, 1]> (x, w, b)
}}
"""
MATMUL = f"""
g (float[1, 32, 16] x) => (float[1, 32, 4] y) <float[16, 4] w = {{{_weights((16, 4), 2)}}}>
{{
    y = MatMul (x, w)
}}
"""


def _feeds(shape, n, seed=0):
    """Correlated inputs (a shared component in every channel): what makes round-to-nearest poor."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        shared = shape[:1] + (1,) + shape[2:] if len(shape) == 4 else shape[:-1] + (1,)
        common = rng.standard_normal(shared)
        x = 2.0 * common + 0.3 * rng.standard_normal(shape)
        out.append({"x": x.astype(np.float32)})
    return out


def _quantize(text, config, passes, feeds):
    ctx = RunContext(config, feeds)
    q, _ = run_pipeline(model_from_text(text), passes, ctx=ctx)
    proto = q.to_proto()
    check_onnx(proto)
    return q, proto, ctx.findings.as_dict()


def _snr(text, proto, evals):
    ref = np.concatenate([run(parse(text), f)[0].ravel() for f in evals])
    got = np.concatenate([run(proto, f)[0].ravel() for f in evals])
    return snr_db(ref, got)


@pytest.mark.parametrize("text, shape", [(CONV, (1, 8, 12, 12)), (MATMUL, (1, 32, 16))])
def test_a16w8_output_error_drops_and_weights_stay_on_their_grid(text, shape):
    feeds, evals = _feeds(shape, 8), _feeds(shape, 4, seed=1)
    _, before_proto, _ = _quantize(text, A16W8, WITHOUT, feeds)
    q, proto, findings = _quantize(text, A16W8, WITH, feeds)
    before, after = _snr(text, before_proto, evals), _snr(text, proto, evals)
    assert after > before + 1, (before, after)   # measured: conv 40.0 -> 41.7 dB, matmul 39.9 -> 46.6 dB
    assert findings["round-weights"]["rounded"] == 1 and findings["round-weights"]["checked"]["kept"]
    assert q.decisions["weight_rounding"]["rounded"] == 1
    assert any("round-weights" in why for why in q.quant["w"].why)
    model = model_from_text(text)   # the pass alone: values on the grid of unchanged scales
    run_passes("annotate-types,calibrate,compute-qparams", model, A16W8, feeds)
    scales = list(model.quant["w"].scale)
    run_passes("round-weights", model, A16W8, feeds)
    tq = model.quant["w"]
    assert list(tq.scale) == scales
    values = np.asarray(model.tensors()["w"].values)
    axis = 0 if text is CONV else 1
    scale = np.expand_dims(np.asarray(tq.scale, np.float32), [a for a in range(values.ndim) if a != axis])
    codes = quantize_values(values, tq.scale, tq.zero_point, tq.qtype, axis)
    np.testing.assert_array_equal((codes.astype(np.float32) - 0) * scale, values)   # exactly on the grid
    original = np.asarray(model_from_text(text).tensors()["w"].values)
    assert not np.array_equal(codes, quantize_values(original, tq.scale, tq.zero_point, tq.qtype, axis))


def test_the_mean_output_change_leaves_the_bias():
    feeds = _feeds((1, 8, 12, 12), 8)
    model = model_from_text(CONV)
    run_passes("annotate-types,calibrate,compute-qparams,round-weights", model, A16W8, feeds)
    rounded = model.to_proto()
    assert any("round-weights" in why for why in model.quant["b"].why)
    mean = lambda proto: np.mean([run(proto, f)[0].mean(axis=(0, 2, 3)) for f in feeds], axis=0)  # noqa: E731
    float_mean, rounded_mean = mean(parse(CONV)), mean(rounded)
    np.testing.assert_allclose(rounded_mean, float_mean, atol=1e-5)   # per channel, on the calibration feeds
    plain = model_from_text(CONV)
    run_passes("annotate-types,calibrate,compute-qparams,round-weights{correct_bias=false}", plain, A16W8, feeds)
    assert np.abs(mean(plain.to_proto()) - float_mean).max() > 10 * np.abs(rounded_mean - float_mean).max()


def test_8_bit_inputs_are_left_alone_by_default():
    feeds = _feeds((1, 8, 12, 12), 4)
    q, _, findings = _quantize(CONV, {"cpu": "x86-64-vnni"}, WITH, feeds)
    assert "round-weights" not in findings and "weight_rounding" not in q.decisions
    assert not any("round-weights" in why for why in q.quant["w"].why)


@pytest.mark.parametrize("chooser", ["round-weights", "reconstruct-weights"])
def test_8_bit_inputs_on_a_pair_safe_grid_are_rounded_and_keep_their_pairs_within_int16(chooser):
    from qpasses.analysis.saturation import qdq_layers, risks
    from qpasses.ir.model import from_proto

    feeds = _feeds((1, 8, 12, 12), 8)
    passes = f"annotate-types,calibrate,compute-qparams,protect-pair-sums{{data=false}},{chooser},insert-qdq"
    q, proto, findings = _quantize(CONV, {}, passes, feeds)
    assert q.decisions["pair_sums"]["layers"]["w"]["fix"] == "grid" and findings[chooser]
    assert not risks(qdq_layers(from_proto(proto)))
    nearest, _, _ = _quantize(CONV, {}, passes.replace(chooser + ",", ""), feeds)
    evals = _feeds((1, 8, 12, 12), 8, seed=9)
    assert _snr(CONV, proto, evals) > _snr(CONV, nearest.to_proto(), evals)


def test_8_bit_inputs_when_asked_and_a_second_run_changes_nothing():
    feeds = _feeds((1, 8, 12, 12), 4)
    model = model_from_text(CONV)
    run_passes("annotate-types,calibrate,compute-qparams", model, {}, feeds)
    first = run_passes("round-weights{activation_bits=8}", model, {}, feeds)
    assert first[0].modified
    values = np.array(model.tensors()["w"].values)
    second = run_passes("round-weights{activation_bits=8}", model, {}, feeds)
    assert not second[0].modified
    np.testing.assert_array_equal(model.tensors()["w"].values, values)


@pytest.mark.parametrize(("aim_met", "rounded"), [(False, True), (True, False), (None, False)])
def test_8_bit_inputs_are_rounded_when_the_search_ended_below_its_aim(aim_met, rounded):
    """With below_aim, search-precision's saved decision (aim_met False: accuracy short of the aim)
    lets the GPTQ codes reach the 8-bit-input layers; met, or no aim, leaves them alone."""
    feeds = _feeds((1, 8, 12, 12), 4)
    model = model_from_text(CONV)
    run_passes("annotate-types,calibrate,compute-qparams", model, {}, feeds)
    if aim_met is not None:
        model.decisions["precision_search"] = {"target": 12.0, "aim": 25.0, "aim_met": aim_met}
    off = model.copy()
    record = run_passes("round-weights{below_aim=true}", model, {}, feeds)[0]
    assert record.modified is rounded and ("weight_rounding" in model.decisions) is rounded
    assert not run_passes("round-weights", off, {}, feeds)[0].modified   # off by default


def test_layers_with_too_few_input_rows_keep_round_to_nearest():
    feeds = _feeds((1, 32, 16), 3)   # 96 rows for 16 inputs: fewer than min_rows=8 per input
    model = model_from_text(MATMUL)
    run_passes("annotate-types,calibrate,compute-qparams", model, A16W8, feeds)
    values = np.array(model.tensors()["w"].values)
    ctx = RunContext(A16W8, feeds)
    run_passes("round-weights", model, ctx=ctx)
    assert ctx.findings.as_dict()["round-weights"] == {"layers": 1, "rounded": 0, "samples": 3, "too_few_rows": 1}
    np.testing.assert_array_equal(model.tensors()["w"].values, values)
    model = model_from_text(MATMUL)
    run_passes("annotate-types,calibrate,compute-qparams", model, A16W8, feeds)
    ctx = RunContext(A16W8, feeds)
    run_passes("round-weights{samples=3}", model, ctx=ctx)   # 3 feeds of 32 rows cannot be enough: none is read
    assert ctx.findings.as_dict()["round-weights"] == {"layers": 1, "rounded": 0, "samples": 0, "too_few_rows": 1}
    model = model_from_text(MATMUL)
    run_passes("annotate-types,calibrate,compute-qparams", model, A16W8, feeds)
    ctx = RunContext(A16W8, feeds)
    run_passes("round-weights{min_rows=4}", model, ctx=ctx)
    assert ctx.findings.as_dict()["round-weights"]["rounded"] == 1


def _gptq_reference(w, scale, qmin, qmax, h, damping):
    """Textbook GPTQ, one row block, no lazy batches: the codes round_codes must reproduce."""
    w = w.astype(np.float64).copy()
    u = upper_inverse_cholesky(h[None], damping)[0]
    codes = np.zeros_like(w)
    for i in range(w.shape[1]):
        q = np.clip(np.rint(w[:, i] / scale), qmin, qmax)
        codes[:, i] = q
        e = (w[:, i] - q * scale) / u[i, i]
        w[:, i + 1:] -= np.outer(e, u[i, i + 1:])
    return codes


def test_round_codes_match_textbook_gptq_across_batches_and_groups():
    rng = np.random.default_rng(3)
    k = 300   # crosses the 128-column lazy batches
    w = rng.standard_normal((2, 5, k))
    x = rng.standard_normal((2, 600, k)) + rng.standard_normal((2, 600, 1))
    h = x.transpose(0, 2, 1) @ x / 600
    scale = np.abs(w).max(axis=2) / 127
    codes = round_codes(w, scale, np.zeros_like(scale), -128, 127, h, 0.01)
    for g in range(2):
        np.testing.assert_array_equal(codes[g], _gptq_reference(w[g], scale[g][:, None][:, 0], -128, 127, h[g], 0.01))
    rtn = np.clip(np.rint(w / scale[..., None]), -128, 127)
    err = lambda c: sum(np.sum(((w[g] - c[g] * scale[g][:, None]) @ x[g].T) ** 2) for g in range(2))  # noqa: E731
    assert err(codes) < 0.5 * err(rtn)


def _im2col(x, kernel, strides, pads, dilations, groups):
    """Naive receptive fields [G, K, R] for a 2-D conv (loops, for the test)."""
    n, c, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    kh, kw = kernel
    oh = (h + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (w + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    rows = []
    for b in range(n):
        for i in range(oh):
            for j in range(ow):
                patch = xp[b, :, i * strides[0]:i * strides[0] + dilations[0] * (kh - 1) + 1:dilations[0],
                           j * strides[1]:j * strides[1] + dilations[1] * (kw - 1) + 1:dilations[1]]
                rows.append(patch.reshape(groups, -1))
    return np.stack(rows, axis=2)


@pytest.mark.parametrize("attrs, wshape", [
    ({"pads": [1, 1, 1, 1]}, (4, 6, 3, 3)),
    ({"strides": [2, 1], "pads": [0, 1, 2, 1], "dilations": [1, 2]}, (4, 6, 3, 2)),
    ({"group": 6, "pads": [2, 2, 2, 2]}, (6, 1, 5, 5)),
    ({"group": 2, "strides": [2, 2]}, (4, 3, 1, 1)),
])
def test_input_rows_are_the_receptive_fields(attrs, wshape):
    x = np.random.default_rng(0).standard_normal((2, 6, 7, 9)).astype(np.float32)
    geo = conv_geometry(attrs, wshape)
    got = input_rows(x, geo, np.random.default_rng(0))
    want = _im2col(x, wshape[2:], geo.strides, geo.pads, geo.dilations, geo.groups)
    np.testing.assert_allclose(got, want)


@pytest.mark.parametrize("op, attrs, wshape, xshape", [
    ("Conv", {"pads": [1, 1, 1, 1]}, (4, 6, 3, 3), (2, 6, 7, 9)),
    ("Conv", {"strides": [2, 1], "pads": [0, 1, 2, 1], "dilations": [1, 2]}, (4, 6, 3, 2), (2, 6, 7, 9)),
    ("Conv", {"group": 6, "pads": [2, -1, 2, 2]}, (6, 1, 5, 5), (1, 6, 7, 9)),
    ("Conv", {"auto_pad": "SAME_LOWER", "strides": [3]}, (2, 3, 4), (2, 3, 11)),
    ("Conv", {}, (2, 3, 5, 5), (1, 3, 4, 9)),   # no full field fits
    ("ConvTranspose", {"strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 0]}, (6, 2, 3, 3), (1, 6, 5, 4)),
    ("Conv", {}, (8, 256, 3, 3), (1, 256, 40, 40)),   # more fields than the budget
    ("MatMul", {}, (16, 4), (3, 5, 16)),
    ("MatMul", {}, (16, 4), (400_000, 16)),
])
def test_most_rows_are_the_rows_input_rows_takes(op, attrs, wshape, xshape):
    geo = conv_geometry(attrs, wshape, op == "ConvTranspose") if op != "MatMul" else Geometry("dense", wshape[0])
    x = np.ones(xshape, np.float32)
    rows = input_rows(x, geo, np.random.default_rng(0)).shape[2]
    assert most_rows(xshape, geo) == rows
    assert most_rows(("N",) + xshape[1:], geo) >= rows


def test_sampled_input_rows_are_those_receptive_fields(monkeypatch):
    x = np.random.default_rng(4).standard_normal((2, 6, 7, 9)).astype(np.float32)
    geo = conv_geometry({"group": 2, "strides": [2, 1], "pads": [1, 0, 1, 2], "dilations": [1, 2]}, (4, 3, 3, 2))
    every = input_rows(x, geo, np.random.default_rng(0))
    monkeypatch.setattr(rounding, "ROW_FLOPS", 20 * geo.k * geo.k * geo.groups)   # 20 of its rows
    got = input_rows(x, geo, np.random.default_rng(5))
    pick = np.sort(np.random.default_rng(5).choice(every.shape[2], 20, replace=False))
    np.testing.assert_array_equal(got, every[:, :, pick])


def test_input_rows_same_padding_1d_and_sampling():
    x = np.random.default_rng(1).standard_normal((1, 3, 11)).astype(np.float32)
    geo = conv_geometry({"auto_pad": "SAME_UPPER", "strides": [2]}, (2, 3, 4))
    got = input_rows(x, geo, np.random.default_rng(0))
    want = _im2col(x[:, :, None, :], (1, 4), (1, 2), (0, 1, 0, 2), (1, 1), 1)   # SAME_UPPER: 3 pad, 1 before
    np.testing.assert_allclose(got, want)
    dense = Geometry("dense", 16)
    many = np.random.default_rng(2).standard_normal((400_000, 16)).astype(np.float32)
    rows = input_rows(many, dense, np.random.default_rng(0))
    assert rows.shape[0] == 1 and 0 < rows.shape[2] < 400_000
    assert len({tuple(r) for r in rows[0].T}) == rows.shape[2]   # sampled without replacement


GEMM = f"""
g (float[32, 16] x) => (float[32, 4] y)
<float[4, 16] w = {{{_weights((4, 16), 5)}}}, float[1, 4] c = {{0.1, -0.2, 0.3, 0.4}}>
{{
    y = Gemm <transB = 1, alpha = 2.0, beta = 0.5> (x, w, c)
}}
"""


def test_gemm_alpha_beta_bias_keeps_the_mean_output():
    feeds = _feeds((1, 32, 16), 8)
    feeds = [{"x": f["x"][0]} for f in feeds]
    model = model_from_text(GEMM)
    run_passes("annotate-types,calibrate,compute-qparams,round-weights", model, A16W8, feeds)
    assert model.decisions["weight_rounding"]["rounded"] == 1
    mean = lambda proto: np.mean([run(proto, f)[0].mean(axis=0) for f in feeds], axis=0)  # noqa: E731
    np.testing.assert_allclose(mean(model.to_proto()), mean(parse(GEMM)), atol=1e-5)


NARROW = f"""
g (float[1, 2, 16] x) => (float[1, 2, 4] y) <float[16, 4] w = {{{_weights((16, 4), 5)}}}>
{{
    y = MatMul (x, w)
}}
"""


def _half_silent_feeds(n: int) -> list[dict]:
    """The first two feeds leave inputs 8..15 at zero, the others do not."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        x = rng.standard_normal((1, 2, 16))
        x[..., 8:] *= i >= 2
        out.append({"x": x.astype(np.float32)})
    return out


def test_codes_that_score_lower_than_round_to_nearest_are_not_kept():
    """GPTQ fitted to the first two feeds moves the rounding error onto the inputs they leave at zero:
    on the 8 feeds after the 8 the search checked the outputs score far lower than with round-to-nearest,
    which stays."""
    feeds = _half_silent_feeds(16)
    results = {}
    for check in (False, True):
        model = model_from_text(NARROW)
        run_passes("annotate-types,calibrate,compute-qparams", model, A16W8, feeds)
        model.decisions["precision_search"] = {"metric": "snr", "feeds": 8}
        original = np.asarray(model.tensors()["w"].values).copy()
        ctx = RunContext(A16W8, feeds)
        run_pipeline(model, f"round-weights{{samples=2,min_rows=0,check={str(check).lower()}}}", ctx=ctx)
        results[check] = (model, original, ctx.findings.as_dict()["round-weights"])
    (loose, _, loose_found), (checked, original, found) = results[False], results[True]
    assert loose_found["rounded"] == 1 and "checked" not in loose_found
    verdict = found["checked"]
    assert verdict["feeds"] == 8 and verdict["from"] == 8 and not verdict["kept"]
    assert verdict["rounded"] < verdict["round_to_nearest"] - 20
    assert found["rounded"] == 0 and checked.decisions["weight_rounding"]["checked"] == verdict
    np.testing.assert_array_equal(np.asarray(checked.tensors()["w"].values), original)
    assert not any("round-weights" in why for why in checked.quant["w"].why)
    assert any("round-weights" in why for why in loose.quant["w"].why)


def test_serial_blas_runs_one_thread_and_chooses_the_same_codes():
    from threadpoolctl import threadpool_info

    from qpasses.executors.threads import serial_blas

    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 300, 2000))
    h = x @ x.transpose(0, 2, 1) / 2000
    w = rng.standard_normal((1, 16, 300))
    scale, zero = np.full((1, 16), 0.02), np.zeros((1, 16))
    free = round_codes(w, scale, zero, -128, 127, h, 0.01)
    with serial_blas():
        assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} == {1}
        serial = round_codes(w, scale, zero, -128, 127, h, 0.01)
    np.testing.assert_array_equal(serial, free)
