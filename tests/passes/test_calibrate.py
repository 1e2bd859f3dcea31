"""calibrate: ranges from onnxruntime runs, streaming, options vs config, exact `modified`."""
import io

import numpy as np
import onnx
import pytest
from onnx import helper

from qpasses.calibration.augment import activation_tensors
from qpasses.calibration.data import open_data
from qpasses.calibration.ranges import calibrate_ranges, outward
from qpasses.calibration.runner import collect_stats
from qpasses.config.quant_config import QuantConfig, load_config
from qpasses.core.pipeline import PassManager, parse_pipeline, print_pipeline
from qpasses.core.verify import check_onnx
from qpasses.errors import CalibrationDataError, ConfigError, PipelineError
from qpasses.ir.model import from_proto
from qpasses.passes.calibrate import Calibrate
from qpasses.testing import model_from_text, parse, random_feed, run, run_pass, run_passes

METHODS = ("minmax", "percentile", "entropy", "mse", "pow2")

TEXT = """
g (float[N, 4] x, int64[2] shape) => (float[N, 4] y, int64[2] s) {
    w = Constant <value = float[4, 4] {0.5, -1, 2, 0.1, 1, 1, -1, 0.3, 0.2, -0.4, 0.9, 1, 0, 2, -2, 1}> ()
    w2 = Mul(w, w)
    m = MatMul(x, w2)
    r = Relu(m)
    t = Tanh(m)
    a = Add(r, t)
    s = Identity(shape)
    y = Sigmoid(a)
}
"""
FLOATS = ["x", "m", "r", "t", "a", "y"]


def _model():
    return model_from_text(TEXT)


def _feeds(n, batch=1, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": (rng.standard_normal((batch, 4)) * 3).astype(np.float32), "shape": np.array([1, 4])}
            for _ in range(n)]


def _reference_minmax(proto, feeds, names):
    """numpy min/max of every tensor as onnxruntime computes it (each exposed as an output)."""
    ref = onnx.ModelProto()
    ref.CopyFrom(proto)
    for name in names:
        if name not in [o.name for o in ref.graph.output]:
            ref.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    outs = {n: [] for n in names}
    for feed in feeds:
        for n, v in zip([o.name for o in ref.graph.output], run(ref, feed)):
            if n in outs:
                outs[n].append(v)
    return {n: (float(np.min(np.concatenate([v.ravel() for v in vs]))),
                float(np.max(np.concatenate([v.ravel() for v in vs])))) for n, vs in outs.items()}


def test_minmax_ranges_equal_numpy_min_max_of_ort_outputs():
    model = _model()
    proto = model.to_proto()
    feeds = _feeds(6)
    result = run_pass(Calibrate(method="minmax"), model, data=open_data(feeds))
    assert result.modified and result.stats == {"tensors": 6, "samples": 6, "method": "minmax"}
    assert list(model.ranges) == FLOATS  # graph order; no constants, no int tensors
    expected = _reference_minmax(proto, feeds, FLOATS)
    for name in FLOATS:
        np.testing.assert_allclose(model.ranges[name], outward(*expected[name]), rtol=1e-6, atol=1e-7)
        assert model.observed[name] == model.ranges[name]
        assert all(type(v) is float for v in model.ranges[name])


@pytest.mark.parametrize("method", METHODS)
def test_streaming_one_batch_equals_many_samples(method):
    many = _feeds(8, seed=3)
    one = [{"x": np.concatenate([f["x"] for f in many]), "shape": many[0]["shape"]}]
    a = calibrate_ranges(_model(), many, method=method, num_bins=256)
    b = calibrate_ranges(_model(), one, method=method, num_bins=256)
    assert a[0] == b[0] and a[1] == b[1]
    assert (a[2], b[2]) == (8, 1)


def test_second_run_not_modified_and_new_data_modifies():
    model = _model()
    feeds = _feeds(4)
    assert run_pass(Calibrate(), model, data=feeds).modified
    assert not run_pass(Calibrate(), model, data=feeds).modified
    assert run_pass(Calibrate(), model, data=_feeds(4, seed=9)).modified


def test_graph_untouched_and_checker_clean():
    model = _model()
    before = onnx.printer.to_text(model.to_proto().graph)
    run_passes("calibrate{method=entropy}", model, data=_feeds(3))
    assert onnx.printer.to_text(model.to_proto().graph) == before
    assert [i.name for i in model.graph.inputs] == ["x", "shape"]
    assert "calibrated" in model.facts
    check_onnx(model)


def test_no_data_is_a_one_line_error():
    with pytest.raises(CalibrationDataError, match=r"calibrate: no calibration data \(pass --calib"):
        PassManager("calibrate").run(_model())


def test_options_default_to_config_and_override_it():
    model = _model()
    config, feeds = load_config({"calibration": {"method": "percentile", "percentile": 90}}), _feeds(5)
    stats = run_passes("calibrate", model, config, feeds)[0].stats
    assert stats["method"] == "percentile"
    pct90 = dict(model.ranges)
    run_passes("calibrate{percentile=100}", model, config, feeds)
    assert model.ranges["m"] == pytest.approx(model.observed["m"])
    assert model.ranges["m"][1] > pct90["m"][1]
    assert run_passes("calibrate{method=minmax}", model, config, feeds)[0].stats["method"] == "minmax"
    with pytest.raises(ConfigError, match="percentile"):
        run_passes("calibrate{percentile=150}", model, config, feeds)


def test_pipeline_text_round_trips():
    text = "calibrate{method=percentile,percentile=99.99,symmetric=true,max_samples=3}"
    assert print_pipeline(parse_pipeline(text)) == text
    assert print_pipeline(parse_pipeline("calibrate")) == "calibrate"
    with pytest.raises(PipelineError, match="not one of"):
        parse_pipeline("calibrate{method=kl2}")


def test_max_samples_and_data_option(tmp_path):
    feeds = _feeds(5)
    np.savez(tmp_path / "c.npz", x=np.stack([f["x"] for f in feeds]), shape=np.stack([f["shape"] for f in feeds]))
    model = _model()
    stats = PassManager(f"calibrate{{data={tmp_path / 'c.npz'},max_samples=2,method=minmax}}").run(model)[0].stats
    assert stats["samples"] == 2
    assert model.ranges["x"] == pytest.approx(outward(*_reference_minmax(model.to_proto(), feeds[:2], ["x"])["x"]))


def test_symmetric_and_moving_average():
    model = _model()
    config = QuantConfig(calibration={"method": "minmax", "moving_average": True, "averaging_constant": 0.5})
    run_pass(Calibrate(), model, config, _feeds(3))
    raw = model.observed["m"]
    per_sample = [_reference_minmax(model.to_proto(), [f], ["m"])["m"] for f in _feeds(3)]
    lo = per_sample[0][0]
    for s in per_sample[1:]:
        lo += 0.5 * (s[0] - lo)
    assert model.ranges["m"][0] == pytest.approx(outward(lo, 0.0)[0]) and model.ranges["m"][0] > raw[0]
    run_pass(Calibrate(symmetric=True, moving_average=False), model, config, _feeds(3))
    assert model.ranges["m"] == (-max(map(abs, raw)), max(map(abs, raw)))


def test_bad_sample_names_source_and_index():
    model = _model()
    feeds = _feeds(2) + [{"x": np.zeros((1, 5), np.float32), "shape": np.array([1, 4])}]
    with pytest.raises(CalibrationDataError, match=r"sample 2: input 'x' has shape \(1, 5\)"):
        run_passes("calibrate", model, data=feeds)


def test_subgraph_tensors_and_float16_and_double():
    text = """
    g (float16[2] h, double[2] d, bool c) => (float16[2] y, double[2] z) {
        y = Relu(h)
        z = If(c) <then_branch = t () => (double[2] o) { o = Neg(d) },
                   else_branch = e () => (double[2] o2) { o2 = Abs(d) }>
    }
    """
    model = model_from_text(text)
    feeds = [{"h": np.array([-1, 2], np.float16), "d": np.array([3.0, -4.0]), "c": np.array(True)}]
    ranges, observed, n = calibrate_ranges(model, feeds)
    # body tensors come after the main graph's; the else branch never ran: o2 has no range
    assert list(ranges) == ["h", "d", "y", "z", "o"]
    assert ranges["y"] == (0.0, 2.0) and ranges["z"] == (-3.0, 4.0) and ranges["o"] == (-3.0, 4.0)


def test_activation_tensors_skip_constants_and_ints():
    names = [n for n, _ in activation_tensors(parse(TEXT))]
    assert names == FLOATS


def test_progress_bar_writes_carriage_returns():
    stream = io.StringIO()
    collect_stats(_model(), _feeds(3), progress_stream=stream)
    text = stream.getvalue()
    assert text.count("\r") == 3 and "3/3" in text and text.endswith("\n")


def test_example_runs():
    model = from_proto(parse(Calibrate.example))
    result = run_pass(Calibrate(), model, data=[random_feed(model, seed=s) for s in range(8)])
    assert result.modified and set(model.ranges) == {"x", "h", "y"}
    assert model.ranges["h"][0] == 0.0


def test_in_memory_weights_path_gives_the_same_ranges():
    """The >2 GB path (weights handed to onnxruntime as in-memory external data) is exercised on a
    small model: same ranges as the serialised path."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", onnx.TensorProto.FLOAT, [64, 64], rng.standard_normal(4096).astype(np.float32))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])], [w])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 10
    feeds = [random_feed(proto, seed=s) for s in range(3)]
    a = collect_stats(from_proto(proto), feeds, in_memory_weights=True)[0]
    b = collect_stats(from_proto(proto), feeds, in_memory_weights=False)[0]
    assert list(a) == list(b)
    for name in a:   # without prepacked weights, onnxruntime's MatMul sums in another order
        np.testing.assert_allclose(a[name].observed, b[name].observed, rtol=1e-5, err_msg=name)
    assert a["y"].observed[1] > 0


def test_after_annotate_types_only_range_sourced_activations_are_measured():
    model = model_from_text("""
    g (float[1, 4] x) => (float[1, 2, 2] y) <float[4, 4] w = {0.5, -1, 2, 0.1, 1, 1, -1, 0.3, 0.2, -0.4, 0.9, 1, 0, 2, -2, 1},
                                              int64[3] shape = {1, 2, 2}> {
        m = MatMul(x, w)
        r = Relu(m)
        t = Tanh(r)
        y = Reshape(t, shape)
    }
    """)
    every_op = QuantConfig(op_types_to_quantize="all")   # Tanh stays float by default
    run_passes("annotate-types", model, every_op)
    needed = {n for n, tq in model.quant.items() if tq.role == "activation" and tq.shares is None}
    sharing = {n for n, tq in model.quant.items() if tq.shares is not None}
    assert needed == {"x", "r", "t"} and sharing == {"m", "y"}  # m merged into Relu, y reshapes t
    feeds = [{"x": f["x"]} for f in _feeds(4)]
    run_passes("calibrate", model, every_op, feeds)
    assert set(model.ranges) == needed
    reference = _reference_minmax(model.to_proto(), feeds, sorted(needed))
    for name in needed:
        np.testing.assert_allclose(model.ranges[name], outward(*reference[name]), rtol=1e-6)
