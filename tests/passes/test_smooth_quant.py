"""smooth-quant: per-channel activation outliers move into MatMul/Gemm weights, exactly in float."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qpasses.analysis.smoothing import ChannelStats, choose, layer_error, outlier_ratio, smoothing_scale
from qpasses.api import run_pipeline
from qpasses.core.context import RunContext
from qpasses.core.pipeline import QUANTIZE_PIPELINE
from qpasses.core.verify import check_onnx, check_structure
from qpasses.evaluation.evaluate import snr_db
from qpasses.ir.model import from_proto
from qpasses.passes.smooth_quant import SmoothQuant
from qpasses.testing import run, run_pass, run_passes

K, N, T = 16, 8, 12
OUTLIERS = {3: 60.0, 11: 25.0}   # channel -> gain


def _gamma():
    g = np.ones(K, np.float32)
    for c, v in OUTLIERS.items():
        g[c] = v
    return g


def _w(shape, seed):
    return np.random.default_rng(seed).normal(0, 0.3, shape).astype(np.float32)


def _model(nodes, inits, outputs=("y",), out_shapes=None, inputs=(("x", [1, T, K]),), graph_inputs_extra=()):
    out_shapes = out_shapes or {o: None for o in outputs}
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs] + list(graph_inputs_extra),
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, out_shapes.get(o)) for o in outputs],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True).graph.output
    del m.graph.output[:]
    m.graph.output.extend(inferred)   # the outputs' shapes from shape inference
    return m


def ln_matmul(extra_reader=False, graph_output=False):
    """x -> LayerNorm (gains with outliers) -> h -> MatMul w [-> also Add(h, x)] -> y."""
    inits = {"gamma": _gamma(), "beta": np.linspace(-0.1, 0.1, K).astype(np.float32), "w": _w((K, N), 1)}
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], axis=-1),
             helper.make_node("MatMul", ["h", "w"], ["y"])]
    outputs = ["y"]
    if extra_reader:
        nodes.append(helper.make_node("Add", ["h", "x"], ["r"]))
        outputs.append("r")
    if graph_output:
        outputs.append("h")
    return _model(nodes, inits, outputs)


def feeds(n=8, seed=0, shape=(1, T, K)):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


def _smooth(proto, data=None, **options):
    m = from_proto(proto)
    ctx = RunContext(None, feeds() if data is None else data)
    result = run_pass(SmoothQuant(**options), m, ctx=ctx)
    check_structure(m)
    check_onnx(m)
    return m, result, ctx


def _same_outputs(before, after, data, rtol=1e-4):
    for f in data:
        for ref, got in zip(run(before, f), run(after, f), strict=True):
            assert np.abs(got - ref).max() <= rtol * np.abs(ref).max(), np.abs(got - ref).max()


def _consts(m):
    return {t.name: np.asarray(t.values) for t in m.tensors().values() if hasattr(t, "values")}


def test_folds_one_over_s_into_the_layernorm_and_s_into_the_weight():
    proto = ln_matmul()
    m, result, ctx = _smooth(proto)
    assert result.modified and result.stats == {"examined": 1, "layers": 1}
    assert [n.op for n in m.graph.nodes] == ["LayerNormalization", "MatMul"]   # no Mul: folded
    c = _consts(m)
    s = (c["w"] / _w((K, N), 1))[:, 0]
    np.testing.assert_allclose(c["w"], _w((K, N), 1) * s[:, None], rtol=1e-5)
    np.testing.assert_allclose(c["gamma"], _gamma() / s, rtol=1e-5)
    assert s[3] > 5 * np.median(s) and s[11] > 2 * np.median(s)   # the outliers are divided most
    decision = m.decisions["smooth_quant"]["layers"]["h"]
    assert decision["alpha"] in (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
    assert decision["error_db_after"] > decision["error_db_before"] + 0.5
    assert "LayerNormalization" in decision["how"]
    row = ctx.findings.as_dict()["smooth-quant"]["layers"][0]
    assert row["tensor"] == "h" and row["outlier_ratio"] > 8 and len(row["error_db"]) == 9
    _same_outputs(proto, m, feeds(4, seed=5))


def test_second_run_changes_nothing():
    m, _, _ = _smooth(ln_matmul())
    before = m.to_proto().SerializeToString()
    again = run_pass(SmoothQuant(), m, data=feeds())
    assert not again.modified and m.to_proto().SerializeToString() == before


def test_shared_input_gets_one_mul_with_the_same_scale_for_every_reader():
    """q, k, v read the LayerNorm output and a residual Add reads it too: the LayerNorm cannot
    absorb 1/s, so one Mul by 1/s feeds all three MatMuls, whose weights get the same s."""
    inits = {"gamma": _gamma(), "beta": np.zeros(K, np.float32), "wq": _w((K, N), 1), "wk": _w((K, N), 2),
             "wv": _w((K, N), 3) * np.linspace(0.1, 3, K, dtype=np.float32)[:, None]}
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], axis=-1),
             helper.make_node("MatMul", ["h", "wq"], ["q"]), helper.make_node("MatMul", ["h", "wk"], ["k"]),
             helper.make_node("MatMul", ["h", "wv"], ["v"]), helper.make_node("Add", ["h", "x"], ["r"])]
    proto = _model(nodes, inits, ["q", "k", "v", "r"])
    m, result, _ = _smooth(proto)
    assert result.modified
    muls = [n for n in m.graph.nodes if n.op == "Mul"]
    assert len(muls) == 1
    smoothed = muls[0].outputs[0]
    assert sorted(n.name for n in smoothed.outputs) == sorted(n.name for n in m.graph.nodes if n.op == "MatMul")
    assert [n.op for n in m.graph.nodes if n.inputs and n.inputs[0].name == "h"] == ["Mul", "Add"]
    c = _consts(m)
    inv = c[muls[0].inputs[1].name]
    for name in ("wq", "wk", "wv"):
        np.testing.assert_allclose(c[name] * inv[:, None], inits[name], rtol=1e-5)
    # s_j uses the largest |W_j| over the three weights
    _same_outputs(proto, m, feeds(4, seed=5))


def test_graph_output_activation_is_not_folded_into_its_producer():
    proto = ln_matmul(graph_output=True)
    m, result, _ = _smooth(proto)
    assert result.modified and [n.op for n in m.graph.nodes] == ["LayerNormalization", "Mul", "MatMul"]
    np.testing.assert_array_equal(_consts(m)["gamma"], _gamma())
    _same_outputs(proto, m, feeds(4, seed=5))


def test_folds_into_a_mul_by_a_constant_shared_with_another_node():
    """GELU's last Mul by 0.5 (after cleanup, one 0.5 initializer shared with another node): a new
    per-channel constant 0.5/s replaces it for this Mul only."""
    inits = {"c": np.asarray(0.5, np.float32), "g": _gamma(), "w": _w((K, N), 4)}
    nodes = [helper.make_node("Mul", ["x", "g"], ["a"]), helper.make_node("Mul", ["a", "c"], ["h"]),
             helper.make_node("MatMul", ["h", "w"], ["y"]), helper.make_node("Mul", ["x", "c"], ["z"])]
    proto = _model(nodes, inits, ["y", "z"])
    m, result, _ = _smooth(proto)
    assert result.modified
    c = _consts(m)
    assert c["c"].shape == () and c["c"] == 0.5            # the other reader's constant is untouched
    mul = next(n for n in m.graph.nodes if n.outputs[0].name == "h")
    assert mul.inputs[1].name == "c_smooth" and mul.inputs[1].values.shape == (K,)
    assert [n.op for n in m.graph.nodes].count("Mul") == 3
    _same_outputs(proto, m, feeds(4, seed=5))


def test_folds_through_a_bias_add_into_the_previous_matmul():
    """h = MatMul(x, w0) + b0 with a few large output columns -> MatMul(h, w1): w0's columns and b0
    are divided by s, w1's rows multiplied."""
    w0 = _w((K, K), 5) * _gamma()[None, :]
    inits = {"w0": w0, "b0": np.linspace(-1, 1, K).astype(np.float32), "w1": _w((K, N), 6)}
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["m0"]), helper.make_node("Add", ["m0", "b0"], ["h"]),
             helper.make_node("MatMul", ["h", "w1"], ["y"])]
    proto = _model(nodes, inits)
    m, result, ctx = _smooth(proto)
    assert result.modified and [n.op for n in m.graph.nodes] == ["MatMul", "Add", "MatMul"]
    c = _consts(m)
    s = c["w1"][:, 0] / inits["w1"][:, 0]
    np.testing.assert_allclose(c["w0"], w0 / s[None, :], rtol=1e-5)
    np.testing.assert_allclose(c["b0"], inits["b0"] / s, rtol=1e-5, atol=1e-7)
    rows = {r["tensor"]: r for r in ctx.findings.as_dict()["smooth-quant"]["layers"]}
    assert rows["x"]["left"] == "no outlier channels" and "MatMul" in rows["h"]["how"]
    _same_outputs(proto, m, feeds(4, seed=5))


def test_gemm_with_transposed_weight_and_a_div_before_it():
    inits = {"d": (1.0 / _gamma()).astype(np.float32), "b": _w((N, K), 7), "c": np.linspace(0, 1, N).astype(np.float32)}
    nodes = [helper.make_node("Div", ["x", "d"], ["h"]), helper.make_node("Gemm", ["h", "b", "c"], ["y"], transB=1)]
    proto = _model(nodes, inits, inputs=(("x", [T, K]),))
    m, result, _ = _smooth(proto, data=feeds(shape=(T, K)))
    assert result.modified
    c = _consts(m)
    s = c["b"][0] / inits["b"][0]
    np.testing.assert_allclose(c["d"], inits["d"] * s, rtol=1e-5)
    np.testing.assert_array_equal(c["c"], inits["c"])
    _same_outputs(proto, m, feeds(4, seed=5, shape=(T, K)))


def test_no_outliers_no_change_and_the_finding_says_so():
    proto = ln_matmul()
    for t in proto.graph.initializer:
        if t.name == "gamma":
            t.CopyFrom(numpy_helper.from_array(np.ones(K, np.float32), "gamma"))
    m, result, ctx = _smooth(proto)
    assert not result.modified and "smooth_quant" not in m.decisions
    assert ctx.findings.as_dict()["smooth-quant"]["layers"][0]["left"] == "no outlier channels"


def test_without_calibration_data_it_says_why():
    m = from_proto(ln_matmul())
    ctx = RunContext(None, None)
    assert not run_pass(SmoothQuant(), m, ctx=ctx).modified
    assert ctx.findings.as_dict()["smooth-quant"] == {"skipped": "no calibration data in this run"}


def test_weight_the_user_may_feed_is_left_alone():
    proto = ln_matmul()
    proto.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [K, N]))
    m, result, _ = _smooth(proto)
    assert not result.modified and result.stats["examined"] == 0


def test_choose_takes_the_alpha_of_least_measured_error():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, K)).astype(np.float32) * _gamma()
    stats = ChannelStats(x.min(0), x.max(0), x)
    w = [_w((K, N), 1)]
    alphas = [0.5, 0.7, 0.9]
    c = choose(stats, w, alphas, min_ratio=8, min_gain_db=0.5)
    assert c.alpha == min(alphas, key=lambda a: c.errors[a]) and c.errors[c.alpha] < c.errors["none"]
    np.testing.assert_allclose(c.scale, smoothing_scale(stats.amax, np.abs(w[0]).max(axis=1), c.alpha))
    assert c.errors[c.alpha] == layer_error(stats, w, c.scale)
    assert choose(stats, w, alphas, min_ratio=8, min_gain_db=60).alpha is None   # no alpha gains 60 dB
    assert choose(stats, w, alphas, min_ratio=1e4, min_gain_db=0.5).errors == {}   # ratio below the threshold
    assert outlier_ratio(stats.amax) > 20


def test_quantized_output_gains_from_smoothing():
    """The default pipeline (smooth-quant after the first cleanup) beats it without on the outlier model."""
    proto = ln_matmul()
    data, evals = feeds(16), feeds(8, seed=9)
    without = QUANTIZE_PIPELINE.replace("smooth-quant,", "")
    with_sq = without.replace("cleanup,", "cleanup,smooth-quant,", 1)
    assert with_sq == QUANTIZE_PIPELINE   # the default runs it after the first cleanup

    def snr(passes):
        q, _ = run_pipeline(from_proto(proto), passes, ctx=RunContext(None, data))
        q_proto = check_onnx(q)
        ref = np.concatenate([run(proto, f)[0].ravel() for f in evals])
        got = np.concatenate([run(q_proto, f)[0].ravel() for f in evals])
        return snr_db(ref, got)

    base, smoothed = snr(without), snr(with_sq)
    assert smoothed > base + 2, (base, smoothed)   # measured: 35.5 -> 39.1 dB (y's own 8-bit grid caps it)


class _Reader:
    """An onnxruntime-style CalibrationDataReader without rewind()."""

    def __init__(self, data):
        self.data = list(data)

    def get_next(self):
        return self.data.pop(0) if self.data else None


def test_data_that_can_be_read_once_is_left_to_calibrate():
    for data in (iter(feeds()), _Reader(feeds())):
        m = from_proto(ln_matmul())
        ctx = RunContext(None, data)
        records = run_passes("smooth-quant,calibrate", m, ctx=ctx)
        assert [r.modified for r in records] == [False, True]
        assert "read only once" in ctx.findings.as_dict()["smooth-quant"]["skipped"]
        assert "h" in m.ranges


def test_stop_after_it_and_resume_gives_the_same_bytes():
    """Its decision and edits live in the saved model: a run cut after smooth-quant and resumed from
    the saved model writes what the uninterrupted default pipeline writes."""
    passes = QUANTIZE_PIPELINE.split(",")
    cut = passes.index("smooth-quant") + 1
    whole, _ = run_pipeline(from_proto(ln_matmul()), QUANTIZE_PIPELINE, ctx=RunContext(None, feeds(16)))
    part, _ = run_pipeline(from_proto(ln_matmul()), ",".join(passes[:cut]), ctx=RunContext(None, feeds(16)))
    assert "smooth_quant" in part.decisions
    resumed, records = run_pipeline(from_proto(part.to_proto()), QUANTIZE_PIPELINE, ctx=RunContext(None, feeds(16)))
    assert not next(r for r in records if r.name == "smooth-quant").modified
    assert resumed.to_proto().SerializeToString() == whole.to_proto().SerializeToString()


def test_off_in_the_config_it_does_nothing():
    """``smooth_quant: false`` (onnxruntime's ``SmoothQuant: False``, its default) is honoured: no
    float run, the graph unchanged, the reason in the findings."""
    m = from_proto(ln_matmul())
    ctx = RunContext({"extra_options": {"SmoothQuant": False}}, feeds())
    before = m.to_proto(metadata=False).SerializeToString()
    result = run_pass(SmoothQuant(), m, ctx=ctx)
    assert not result.modified and m.to_proto(metadata=False).SerializeToString() == before
    assert ctx.findings.as_dict()["smooth-quant"] == {"skipped": "smooth_quant is false in the config"}
    assert run_pass(SmoothQuant(), from_proto(ln_matmul()), ctx=RunContext(None, feeds())).modified   # on by default
