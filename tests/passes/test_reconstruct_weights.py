"""reconstruct-weights: codes (and biases) chosen against the quantized model's own inputs to each layer."""

import numpy as np
import onnx
import pytest

from qpasses.analysis.weighted_layers import find_targets
from qpasses.api import run_pipeline
from qpasses.core.context import RunContext
from qpasses.core.pipeline import parse_pipeline
from qpasses.core.verify import check_onnx
from qpasses.errors import PipelineError
from qpasses.evaluation.evaluate import session, snr_db
from qpasses.ir.model import load
from qpasses.quant.qparams import quantize as quantize_values
from qpasses.quant.rounding import Geometry, Hessian, conv_geometry, input_rows, paired_rows, refine_codes, round_codes
from qpasses.testing import model_from_text, parse, run, run_passes

from tests.integration.test_control_flow import _feeds as control_flow_feeds, vad_model

PRELUDE = "annotate-types,calibrate,compute-qparams"
THEN = "fix-bias-scales,insert-qdq,insert-converts"


def _w(shape, seed, scale=0.3):
    return ", ".join(f"{v:.4f}" for v in np.random.default_rng(seed).standard_normal(int(np.prod(shape))) * scale)


def _b(n, seed):
    return _w((n,), seed, 0.1)


CONV = f"""
g (float[1, 8, 12, 12] x) => (float[1, 6, 12, 12] y)
<float[8, 8, 3, 3] w1 = {{{_w((8, 8, 3, 3), 3, 0.2)}}}, float[8] b1 = {{{_b(8, 4)}}},
 float[6, 8, 3, 3] w = {{{_w((6, 8, 3, 3), 1)}}}, float[6] b = {{{_b(6, 5)}}}>
{{
    h = Conv <pads = [1, 1, 1, 1]> (x, w1, b1)
    r = Relu (h)
    y = Conv <pads = [1, 1, 1, 1]> (r, w, b)
}}
"""
DEPTHWISE = f"""
g (float[1, 8, 12, 12] x) => (float[1, 6, 12, 12] y)
<float[8, 1, 3, 3] w1 = {{{_w((8, 1, 3, 3), 3)}}}, float[8] b1 = {{{_b(8, 4)}}},
 float[6, 8, 1, 1] w = {{{_w((6, 8, 1, 1), 1)}}}, float[6] b = {{{_b(6, 5)}}}>
{{
    h = Conv <pads = [1, 1, 1, 1], group = 8> (x, w1, b1)
    r = Relu (h)
    y = Conv (r, w, b)
}}
"""
CONV_TRANSPOSE = f"""
g (float[1, 8, 12, 12] x) => (float[1, 4, 24, 24] y)
<float[8, 8, 3, 3] w1 = {{{_w((8, 8, 3, 3), 3, 0.2)}}}, float[8] b1 = {{{_b(8, 4)}}},
 float[8, 4, 2, 2] w = {{{_w((8, 4, 2, 2), 1)}}}, float[4] b = {{{_b(4, 5)}}}>
{{
    h = Conv <pads = [1, 1, 1, 1]> (x, w1, b1)
    r = Relu (h)
    y = ConvTranspose <strides = [2, 2]> (r, w, b)
}}
"""
GEMM = f"""
g (float[64, 16] x) => (float[64, 6] y)
<float[12, 16] w1 = {{{_w((12, 16), 3)}}}, float[12] b1 = {{{_b(12, 4)}}}, float[12, 6] w = {{{_w((12, 6), 1)}}}>
{{
    h = Gemm <transB = 1> (x, w1, b1)
    r = Relu (h)
    y = MatMul (r, w)
}}
"""
GRAPHS = {"conv": (CONV, (1, 8, 12, 12)), "depthwise": (DEPTHWISE, (1, 8, 12, 12)),
          "conv_transpose": (CONV_TRANSPOSE, (1, 8, 12, 12)), "gemm_matmul": (GEMM, (64, 16))}


def _feeds(shape, n, seed=0):
    """Correlated inputs (a shared component in every channel): what makes round-to-nearest poor."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        shared = shape[:1] + (1,) + shape[2:] if len(shape) == 4 else shape[:-1] + (1,)
        out.append({"x": (2.0 * rng.standard_normal(shared) + 0.3 * rng.standard_normal(shape)).astype(np.float32)})
    return out


def _quantized(text, passes, feeds, config=None):
    model = model_from_text(text)
    ctx = RunContext(config or {}, feeds)
    run_pipeline(model, passes, ctx=ctx)
    return model, ctx.findings.as_dict()


def _layer_errors(text, proto, feeds) -> dict[str, float]:
    """Per weighted node: the mean squared error of its output in the QDQ model ``proto`` against
    the float model's, on ``feeds``."""
    reference = parse(text)
    layers = {n.name or n.output[0]: n.output[0] for n in reference.graph.node if n.op_type in ("Conv", "ConvTranspose",
                                                                                                     "Gemm", "MatMul")}
    out = {}
    for name, tensor in layers.items():
        runs = []
        for model in (reference, proto):
            m = onnx.ModelProto()
            m.CopyFrom(model)
            m.graph.output.append(onnx.helper.make_empty_tensor_value_info(tensor))
            sess = session(m, optimize=False)
            runs.append(np.concatenate([sess.run([tensor], f)[0].ravel() for f in feeds]))
        out[name] = float(np.mean((runs[0].astype(np.float64) - runs[1]) ** 2))
    return out


def _on_grid(model, name):
    tq = model.quant[name]
    values = np.asarray(model.tensors()[name].values)
    axis = tq.axis if len(tq.scale) > 1 else None
    codes = quantize_values(values, tq.scale if axis is not None else tq.scale[0],
                            tq.zero_point if axis is not None else tq.zero_point[0], tq.qtype, axis)
    shape = [1] * values.ndim
    if axis is not None:
        shape[axis] = -1
    scale = np.reshape(np.asarray(tq.scale, np.float32), shape)
    zero = np.reshape(np.asarray(tq.zero_point, np.float32), shape)
    np.testing.assert_array_equal((codes.astype(np.float32) - zero) * scale, values)
    return codes


@pytest.mark.parametrize("algorithm", ["adaround", "adaquant"])
@pytest.mark.parametrize("graph", GRAPHS)
def test_layer_errors_drop_on_held_out_data_and_codes_stay_on_their_grid(graph, algorithm):
    text, shape = GRAPHS[graph]
    feeds, held_out = _feeds(shape, 16), _feeds(shape, 8, seed=1)
    before, _ = _quantized(text, f"{PRELUDE},{THEN}", feeds)
    after, findings = _quantized(text, f"{PRELUDE},reconstruct-weights{{algorithm={algorithm},check=false}},{THEN}",
                                 feeds)
    proto = after.to_proto()
    check_onnx(proto)
    errors_before, errors_after = _layer_errors(text, before.to_proto(), held_out), _layer_errors(text, proto, held_out)
    assert findings["reconstruct-weights"]["reconstructed"] == 2
    for layer in errors_before:   # measured: 3-38 % lower
        assert errors_after[layer] < errors_before[layer], (layer, errors_before, errors_after)
    ref = np.concatenate([run(parse(text), f)[0].ravel() for f in held_out])
    assert snr_db(ref, np.concatenate([run(proto, f, judged=True)[0].ravel() for f in held_out])) >= \
        snr_db(ref, np.concatenate([run(before.to_proto(), f, judged=True)[0].ravel() for f in held_out]))

    model = model_from_text(text)   # the pass alone: values on the grid of unchanged scales
    run_passes(PRELUDE, model, {}, feeds)
    scales = {t.weight.name: list(model.quant[t.weight.name].scale) for t in find_targets(model, 8, ("Conv", "ConvTranspose",
                                                                                                        "Gemm", "MatMul"))}
    original = {name: np.array(model.tensors()[name].values) for name in scales}
    run_passes(f"reconstruct-weights{{algorithm={algorithm},check=false}}", model, {}, feeds)
    for name, scale in scales.items():
        assert list(model.quant[name].scale) == scale
        codes = _on_grid(model, name)
        tq = model.quant[name]
        axis = tq.axis if len(tq.scale) > 1 else None
        nearest = quantize_values(original[name], tq.scale if axis is not None else tq.scale[0],
                                  tq.zero_point if axis is not None else tq.zero_point[0], tq.qtype, axis)
        assert not np.array_equal(codes, nearest)
        if algorithm == "adaround":   # each code rounds its weight up or down
            assert np.abs(codes.astype(np.int64) - nearest).max() <= 1
        assert any("reconstruct-weights" in why for why in tq.why)


def test_a_second_run_changes_nothing_and_the_table_says_why():
    feeds = _feeds((1, 8, 12, 12), 16)
    model = model_from_text(CONV)
    run_passes(PRELUDE, model, {}, feeds)
    first = run_passes("reconstruct-weights{check=false}", model, {}, feeds)[0]
    assert first.modified and first.stats["reconstructed"] == 2
    values = {n: np.array(model.tensors()[n].values) for n in ("w1", "b1", "w", "b")}
    second = run_passes("reconstruct-weights{check=false}", model, {}, feeds)[0]
    assert not second.modified
    for name, array in values.items():
        np.testing.assert_array_equal(model.tensors()[name].values, array)
    assert model.decisions["weight_reconstruction"]["reconstructed"] == 2
    assert not any("reconstruct-weights" in why for why in model.quant["b"].why)   # no fit_bias: the bias stays
    model = model_from_text(CONV)
    run_passes(f"{PRELUDE},reconstruct-weights{{check=false,fit_bias=true}}", model, {}, feeds)
    assert any("quantized model's inputs" in why for why in model.quant["b"].why)


def test_the_saved_model_holds_what_the_pass_chose(tmp_path):
    """A run resumed from the saved model after the pass gives the same bytes as one run."""
    feeds = _feeds((1, 8, 12, 12), 16)
    whole = model_from_text(CONV)
    run_passes(f"{PRELUDE},reconstruct-weights,{THEN}", whole, {}, feeds)
    first = model_from_text(CONV)
    run_passes(f"{PRELUDE},reconstruct-weights", first, {}, feeds)
    from qpasses.ir.model import save
    resumed = load(str(save(first, tmp_path / "half.onnx")))
    run_passes(f"reconstruct-weights,{THEN}", resumed, {}, feeds)
    assert resumed.to_proto().SerializeToString() == whole.to_proto().SerializeToString()


@pytest.mark.parametrize("options", ["", "fit_bias=true,algorithm=adaquant,stages=0"])
def test_values_kept_between_parts_give_what_running_again_from_the_feeds_gives(options):
    """The staged runs over the stash (two QDQ runs, one float run in all) and the runs of whole
    models from the feeds for every stage choose the same values."""
    feeds = _feeds((1, 8, 12, 12), 16)
    chosen = []
    for stash in ("", "max_stash_mb=0"):
        model = model_from_text(CONV)
        run_passes(f"{PRELUDE},reconstruct-weights{{check=false,{','.join(o for o in (options, stash) if o)}}}",
                   model, {}, feeds)
        chosen.append({n: np.array(model.tensors()[n].values) for n in ("w1", "b1", "w", "b")})
    for name in ("w1", "w"):
        np.testing.assert_array_equal(chosen[0][name], chosen[1][name])
    for name in ("b1", "b"):   # means of float sums taken in other orders
        np.testing.assert_allclose(chosen[0][name], chosen[1][name], rtol=1e-5, atol=1e-7)


def test_round_weights_leaves_reconstructed_codes_alone():
    feeds = _feeds((1, 8, 12, 12), 16)
    model = model_from_text(CONV)
    config = {"activation_type": "uint16"}
    run_passes(f"{PRELUDE},reconstruct-weights{{check=false}}", model, config, feeds)
    values = np.array(model.tensors()["w"].values)
    ctx = RunContext(config, feeds)
    assert not run_passes("round-weights", model, ctx=ctx)[0].modified
    assert ctx.findings.as_dict()["round-weights"] == {"skipped": "reconstruct-weights chose the codes"}
    np.testing.assert_array_equal(model.tensors()["w"].values, values)


def test_values_that_score_lower_on_held_out_feeds_are_dropped():
    feeds = _feeds((1, 8, 12, 12), 24)
    model = model_from_text(CONV)
    run_passes(PRELUDE, model, {}, feeds)
    values = {n: np.array(model.tensors()[n].values) for n in ("w1", "b1", "w", "b")}
    ctx = RunContext({}, feeds)
    record = run_passes("reconstruct-weights{samples=16,check_samples=8,tolerance_db=-1000}", model, ctx=ctx)[0]
    checked = model.decisions["weight_reconstruction"]["checked"]
    assert record.modified and not checked["kept"] and checked["from"] == 16 and checked["feeds"] == 8
    assert model.decisions["weight_reconstruction"]["reconstructed"] == 0
    for name, array in values.items():
        np.testing.assert_array_equal(model.tensors()[name].values, array)
    kept = model_from_text(CONV)
    run_passes(PRELUDE, kept, {}, feeds)
    run_passes("reconstruct-weights{samples=16,check_samples=8}", kept, {}, feeds)
    assert kept.decisions["weight_reconstruction"]["checked"]["kept"]   # measured: 35.6 -> 36.3 dB


def test_weighted_ops_in_if_bodies_are_reconstructed():
    model = vad_model()
    feeds, held_out = control_flow_feeds(model, 64, 1), control_flow_feeds(model, 16, 2)
    outputs = lambda proto: np.concatenate([np.concatenate([a.ravel() for a in run(proto, f, judged=True)]) for f in held_out])  # noqa: E731
    ref = outputs(model)
    before = load(model)
    run_passes(f"{PRELUDE},{THEN}", before, {}, feeds)
    after = load(model)
    ctx = RunContext({}, feeds)
    run_passes(f"{PRELUDE},reconstruct-weights{{samples=64,check=false}},{THEN}", after, ctx=ctx)
    proto = after.to_proto()
    check_onnx(proto)
    assert ctx.findings.as_dict()["reconstruct-weights"]["reconstructed"] == 6   # 3 per branch
    for p in ("k16_", "k8_"):
        for w in ("stft", "enc_w", "dec_w"):
            assert any("reconstruct-weights" in why for why in after.quant[p + w].why), p + w
    assert snr_db(ref, outputs(proto)) > snr_db(ref, outputs(before.to_proto()))   # measured: 45.9 -> 47.1 dB


def test_nothing_to_do_without_integer_weights_or_data():
    feeds = _feeds((1, 8, 12, 12), 4)
    model = model_from_text(CONV)
    run_passes(PRELUDE, model, {"activation_type": "float8e4m3fn", "weight_type": "float8e4m3fn"}, feeds)
    assert not run_passes("reconstruct-weights", model, {}, feeds)[0].modified
    model = model_from_text(CONV)
    run_passes(PRELUDE, model, {}, feeds)
    ctx = RunContext({}, None)
    assert not run_passes("reconstruct-weights", model, ctx=ctx)[0].modified
    assert "no calibration data" in ctx.findings.as_dict()["reconstruct-weights"]["skipped"]


def test_an_unknown_algorithm_is_refused():
    with pytest.raises(PipelineError, match="adaround, adaquant"):
        parse_pipeline("reconstruct-weights{algorithm=brecq}")


# -- the math (qpasses.quant.rounding) ---------------------------------------------------------------
def test_the_moments_give_the_exact_layer_error():
    """error_db from the accumulated moments equals the error computed from the rows themselves,
    and mix=1 / mix=0 give the quantized / float inputs' moments."""
    rng = np.random.default_rng(0)
    geo = Geometry("dense", 6)
    h = Hessian(geo, seed=0)
    xs = [rng.standard_normal((40, 6)).astype(np.float32) for _ in range(3)]
    noisy = [x + 0.1 * rng.standard_normal(x.shape).astype(np.float32) for x in xs]
    for x, xq in zip(xs, noisy):
        h.update(xq, x)
    w, new = rng.standard_normal((1, 4, 6)), rng.standard_normal((1, 4, 6))
    shift = rng.standard_normal(4)
    x, xq = np.concatenate(xs).astype(np.float64), np.concatenate(noisy).astype(np.float64)
    err = np.sum((xq @ new[0].T + shift - x @ w[0].T) ** 2)
    assert h.error_db(w, new, shift) == pytest.approx(10 * np.log10(err / np.sum((x @ w[0].T) ** 2)), abs=1e-6)
    quantized, cross = h.moments(False, 1.0)
    np.testing.assert_allclose(quantized[0], xq.T @ xq / len(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cross[0], xq.T @ x / len(x), rtol=1e-5, atol=1e-6)
    floats, cross = h.moments(False, 0.0)
    np.testing.assert_allclose(floats[0], x.T @ x / len(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cross[0], x.T @ x / len(x), rtol=1e-5, atol=1e-6)


def test_paired_rows_take_the_same_receptive_fields():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 9, 9)).astype(np.float32)
    geo = conv_geometry({"pads": [1, 1, 1, 1], "strides": [2, 2]}, (3, 4, 3, 3))
    a, b = paired_rows([x, 2 * x], geo, np.random.default_rng(1), most=7)
    assert a.shape == (1, 36, 7)
    np.testing.assert_array_equal(b, 2 * a)
    full = input_rows(x, geo, np.random.default_rng(1))
    assert full.shape == (1, 36, 2 * 5 * 5)


def test_conv_transpose_reads_its_input_as_the_conv_it_equals():
    """ConvTranspose(x, W) = W_rows @ rows of x spread by the strides (conv_geometry, to_rows)."""
    from qpasses.analysis.weighted_layers import Target
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4, 5, 6)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 2)).astype(np.float32)   # group 2: [C, O/g, kh, kw]
    attrs = {"strides": [2, 1], "pads": [1, 0, 0, 1], "group": 2, "output_padding": [1, 0]}
    text = f"""
    g (float[1, 4, 5, 6] x) => (float[1, 6, 11, 6] y) <float[4, 3, 3, 2] w = {{{", ".join(map(str, w.ravel()))}}}>
    {{
        y = ConvTranspose <strides = [2, 1], pads = [1, 0, 0, 1], group = 2, output_padding = [1, 0]> (x, w)
    }}
    """
    y = run(parse(text), {"x": x})[0]
    geo = conv_geometry(attrs, w.shape, transposed=True)
    t = Target(None, None, geo, "convT")
    rows = input_rows(x, geo, np.random.default_rng(0))   # [G, K, R], R = every output position
    got = (t.to_rows(w.astype(np.float64)) @ rows).reshape(6, *y.shape[2:])
    np.testing.assert_allclose(got, y[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(t.from_rows(t.to_rows(w), w.shape), w)


@pytest.mark.parametrize("seed", range(3))
def test_refine_codes_never_raises_the_loss_and_keeps_bounds(seed):
    rng = np.random.default_rng(seed)
    k = 20
    a = rng.standard_normal((3, k, 200))
    h = a @ a.transpose(0, 2, 1) / 200 + 0.01 * np.eye(k)
    goal = rng.standard_normal((3, 5, k)) * 3
    lo, hi = np.floor(goal) - (seed == 1), np.floor(goal) + 1
    codes = round_codes(goal, np.ones((3, 5)), np.zeros((3, 5)), lo, hi, h, 0.0)
    loss = lambda q: np.einsum("grk,gkl,grl->gr", q - goal, h, q - goal)  # noqa: E731
    refined, moves = refine_codes(codes, goal, lo, hi, h, 10)
    changed = np.any(refined != codes, axis=2)
    assert np.all(loss(refined)[changed] < loss(codes)[changed]) and np.all(loss(refined) <= loss(codes) + 1e-9)
    assert moves >= np.count_nonzero(refined != codes) > 0   # each changed code moved at least once
    assert refine_codes(refined, goal, lo, hi, h, 10)[1] == 0   # it stopped where no move lowers the loss
    assert np.all(refined >= lo) and np.all(refined <= hi) and np.array_equal(refined, np.rint(refined))
    nearest = np.clip(np.rint(goal), lo, hi)
    assert loss(refined).sum() < loss(nearest).sum()


def test_effort_high_reconstructs_in_the_default_pipeline(tmp_path):
    """config effort: high (or --effort high) puts reconstruct-weights where the default has
    round-weights, and nothing else changes."""
    from qpasses.cli import main
    from qpasses.cli.examples import write_example
    from qpasses.core.pipeline import default_pipeline
    from qpasses.ir.model import load

    high = default_pipeline(True, effort="high").split(",")
    assert "reconstruct-weights" in high and "round-weights" not in high
    default = default_pipeline(True).split(",")
    assert "reconstruct-weights" not in default
    assert high == ["reconstruct-weights" if p == "round-weights" else p for p in default]
    model, calib, _ = write_example(tmp_path)
    out = tmp_path / "q.onnx"
    assert main(["run", str(model), "-o", str(out), "--calib", str(calib), "--effort", "high", "--quiet"]) == 0
    assert load(out).decisions["weight_reconstruction"]["by"] == "reconstruct-weights"
    (tmp_path / "bad.json").write_text('{"effort": "max"}')
    assert main(["run", str(model), "-o", str(tmp_path / "b.onnx"), "--calib", str(calib),
                 "--config", str(tmp_path / "bad.json"), "--quiet"]) == 2
    assert not (tmp_path / "b.onnx").exists()


def _dense(k: int, rows: int) -> onnx.ModelProto:
    """x [1, rows, k] @ w [k, k]: k * k * 4 bytes of weights."""
    w = np.random.default_rng(7).standard_normal((k, k)).astype(np.float32) * 0.1
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, rows, k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, rows, k])],
        [onnx.numpy_helper.from_array(w, "w")])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


@pytest.mark.parametrize("k, reconstructed", [(256, True), (576, False)])   # 0.25 MB, 1.27 MB of weights
def test_max_weight_mb_bounds_the_reconstruction(k, reconstructed):
    """Above ``max_weight_mb`` of weights the pass stands aside (a finding says why) and round-weights
    after it chooses the codes (16-bit activations here, so that it has layers to round)."""
    feeds = _feeds((1, 320, k), 48)
    model = load(_dense(k, 320))
    ctx = RunContext({"activation_type": "uint16"}, feeds)
    run_passes(f"{PRELUDE},reconstruct-weights{{max_weight_mb=1}},round-weights", model, ctx=ctx)
    findings = ctx.findings.as_dict()
    assert findings["reconstruct-weights"].get("reconstructed", 0) == int(reconstructed)
    assert ("skipped" in findings["reconstruct-weights"]) == (not reconstructed)
    assert findings["round-weights"].get("rounded", 0) == int(not reconstructed)
