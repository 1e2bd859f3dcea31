"""Calibration runner: big-weight models run segment-outer (one onnxruntime session at a time over
every sample) and measure exactly what the sample-outer run over the same segments measures."""
import io
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qpasses.analysis.dtypes import infer_types
from qpasses.calibration import ranges, runner, segments
from qpasses.calibration.kept import KeptSamples
from qpasses.ir.model import from_proto
from qpasses.testing import random_feed

WIDTH = 32


def _layered(layers: int = 6, seed: int = 0) -> onnx.ModelProto:
    """MatMul+Add+Relu layers whose weights outweigh the activations, with what segments must
    carry: a Relu placed after the next layer's MatMul (its source is measured one segment
    earlier), a second graph input read only by the last layer, a Reshape of a Relu (a derived
    range of a derived range) and a tensor big enough for ReduceMin/ReduceMax nodes."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits += [numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) / 4).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array((rng.standard_normal(WIDTH) / 4).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"])]
        if i:   # the Relu of the previous layer comes after this layer's MatMul
            nodes.append(helper.make_node("Relu", [f"a{i - 1}"], [f"r{i - 1}"]))
            nodes.append(helper.make_node("Add", [f"r{i - 1}", f"m{i}"], [f"s{i}"]))
        x = f"a{i}" if not i else f"s{i}"
    last = layers - 1
    inits += [numpy_helper.from_array(np.array([1, -1], np.int64), "flat"),
              numpy_helper.from_array(np.array([1, 256], np.int64), "reps")]
    nodes += [helper.make_node("Relu", [f"a{last}"], [f"r{last}"]),
              helper.make_node("Mul", [f"r{last}", "x2"], ["late"]),     # reads the second input
              helper.make_node("Reshape", ["late", "flat"], ["flat_late"]),
              helper.make_node("Relu", ["x2"], ["x2r"]),
              helper.make_node("Tile", [x, "reps"], ["big"]),             # 8192 elements: reduced in onnxruntime
              helper.make_node("Tanh", ["big"], ["y"])]
    graph = helper.make_graph(
        nodes, "layered",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH]),
         helper.make_tensor_value_info("x2", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, WIDTH * 256]),
         helper.make_tensor_value_info("flat_late", TensorProto.FLOAT, [1, WIDTH]),
         helper.make_tensor_value_info("x2r", TensorProto.FLOAT, [1, WIDTH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


@pytest.fixture
def segmented(monkeypatch):
    """Thresholds low enough for the small model to take the big-weight path."""
    monkeypatch.setattr(segments, "IN_MEMORY_BYTES", 1)
    monkeypatch.setattr(runner, "SEGMENT_BYTES", 1)
    monkeypatch.setattr(runner, "SEGMENT_MIN_WEIGHTS", 1)


def _sample_outer_instead(monkeypatch):
    """Run the big-weight plan's segments sample-outer (all sessions alive), same cuts."""
    def sample_outer(plan, feeds, stats, progress, total):
        plan.segments = [s for s in map(plan.build, range(len(plan.parts))) if s is not None]
        return runner._sample_outer(plan, feeds, stats, progress, total)

    monkeypatch.setattr(runner, "_segment_outer", sample_outer)


def _ranges(proto, feeds, method, **options):
    return ranges.calibrate_ranges(from_proto(proto), feeds, method=method, **options)


CASES = [("minmax", {}), ("minmax", {"moving_average": True}), ("entropy", {}), ("percentile", {})]


@pytest.mark.parametrize("method, options", CASES)
def test_segment_outer_measures_what_sample_outer_measures(segmented, monkeypatch, method, options):
    proto = _layered()
    feeds = [random_feed(proto, seed=s) for s in range(5)]
    plan = runner._Plan(from_proto(proto), method != "minmax", samples=len(feeds))
    assert plan.budget > 0 and len(plan.parts) >= 4 and plan.segments == []
    assert plan.owned[0][:2] == ["x", "x2"]
    owner = {n: k for k, names in enumerate(plan.owned) for n in names}
    if method == "minmax":   # derived ranges are updated where their source is measured
        assert owner["x2r"] == 0 and owner["r0"] == owner["a0"] < owner["s1"]
    # a one-shot iterator: read once, by the first segment
    segment_outer = _ranges(proto, (f for f in feeds), method, **options)
    _sample_outer_instead(monkeypatch)
    sample_outer = _ranges(proto, feeds, method, **options)
    assert segment_outer == sample_outer            # same values, same (graph) order
    assert segment_outer[2] == 5
    assert {"x2r", "flat_late", "big", "y", "r0"} <= set(segment_outer[0])
    monkeypatch.setattr(runner, "SEGMENT_BYTES", 2**62)   # the ordinary path: one session
    one = _ranges(proto, feeds, method, **options)
    assert list(one[0]) == list(segment_outer[0])
    for name in one[0]:
        np.testing.assert_allclose(segment_outer[0][name], one[0][name], rtol=1e-5, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(segment_outer[1][name], one[1][name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("method", ["minmax", "entropy"])
def test_a_stash_past_the_budget_finishes_sample_outer(segmented, monkeypatch, method):
    """Samples read before the stash passed the budget finish segment by segment, the others run
    sample-outer: the statistics are still those of the sample-outer run."""
    proto = _layered()
    feeds = [random_feed(proto, seed=s) for s in range(6)]
    prune = runner._Plan.prune
    monkeypatch.setattr(runner._Plan, "prune", lambda self, env, k: prune(self, env, k) * 10**6)
    built = []
    build = runner._Plan.build
    monkeypatch.setattr(runner._Plan, "build", lambda self, k: built.append(k) or build(self, k))
    stats, count = runner.collect_stats(from_proto(proto), (f for f in feeds), method=method)
    parts = max(built) + 1
    assert count == 6 and built == list(range(parts)) * 2   # each part once segment-outer, then all at once
    monkeypatch.setattr(runner._Plan, "prune", prune)
    _sample_outer_instead(monkeypatch)
    ref, _ = runner.collect_stats(from_proto(proto), feeds, method=method)
    assert {n: (s.samples, s.observed) for n, s in stats.items()} == {n: (s.samples, s.observed) for n, s in ref.items()}
    if method == "entropy":
        assert all(np.array_equal(stats[n].hist.counts, ref[n].hist.counts) for n in ref)


def test_a_known_stash_larger_than_the_weights_saved_stays_sample_outer(segmented):
    proto = _layered()
    model = from_proto(proto)
    assert runner._Plan(model, False, samples=4).budget > 0
    plan = runner._Plan(from_proto(proto), False, samples=10**6)   # a million samples of stash
    assert plan.budget == 0 and len(plan.parts) == 1 and len(plan.segments) == 1


def test_weight_limit_cuts_before_the_node_that_would_pass_it():
    proto = _layered(layers=8)
    model = from_proto(proto)
    w = WIDTH * WIDTH * 4
    chain = segments.Chain(model, model.to_proto(), infer_types(model.to_proto())[0], weight_limit=2 * w + 1024)
    assert len(chain.spans) >= 4
    assert all(0 < b <= 2 * w + 1024 for b in chain.span_weights[:-1])
    assert sum(len(s) for s in chain.spans) == len(proto.graph.node)
    stash = chain.stash_bytes(infer_types(proto)[1])
    assert 2 * WIDTH * 4 <= stash <= 4 * WIDTH * 4   # x2 and one or two [1, WIDTH] activations


def test_segment_outer_progress_has_one_line_per_segment(segmented):
    proto = _layered()
    stream = io.StringIO()
    runner.collect_stats(from_proto(proto), [random_feed(proto, seed=s) for s in range(3)], progress_stream=stream)
    lines = stream.getvalue().rstrip("\n").split("\n")
    parts = len(lines)
    assert parts >= 4 and all(f"calibrate {k + 1}/{parts}" in line and line.rstrip().endswith("samples/s")
                              for k, line in enumerate(lines))
    assert all("3/3" in line for line in lines)


def test_a_sample_onnxruntime_rejects_in_a_later_segment_is_named(segmented):
    from qpasses.errors import CalibrationDataError

    proto = _layered()
    feeds = [random_feed(proto, seed=s) for s in range(3)]
    feeds[2]["x2"] = np.ones((1, WIDTH + 1), np.float32)   # only the last layer reads x2
    with pytest.raises(CalibrationDataError, match="sample 2"):
        runner.collect_stats(from_proto(proto), feeds)


def test_default_pipeline_segment_outer_gives_the_ranges_of_sample_outer(segmented, monkeypatch):
    """Through qpasses.quantize (calibrate after annotate-types measures only some tensors)."""
    import qpasses

    proto = _layered()
    feeds = [random_feed(proto, seed=s) for s in range(4)]
    calls = []
    segment_outer = runner._segment_outer
    monkeypatch.setattr(runner, "_segment_outer", lambda *a: calls.append(1) or segment_outer(*a))
    # the method is given: else select-by-snr may switch to min/max on the list of feeds (it can
    # read them again) and not on the one-shot generator
    method = {"calibration": {"method": "percentile"}}
    model = qpasses.quantize(from_proto(proto), (f for f in feeds), config=method)
    assert calls and model.ranges
    _sample_outer_instead(monkeypatch)
    assert qpasses.quantize(from_proto(proto), feeds, config=method).ranges == model.ranges


def test_one_session_keeps_the_first_feeds_and_float_outputs(monkeypatch):
    proto = _layered()
    feeds = [random_feed(proto, seed=s) for s in range(5)]
    kept = KeptSamples(3)
    runner.collect_stats(from_proto(proto), feeds, kept=kept)
    plain = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in plain.get_outputs()]
    assert kept.names == names and len(kept.feeds) == len(kept.outputs) == 3
    for feed, got in zip(kept.feeds, kept.outputs):
        for want, have in zip(plain.run(names, feed), got):
            np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
    small = KeptSamples(3, max_bytes=1)   # over the byte budget: nothing kept
    runner.collect_stats(from_proto(proto), feeds, kept=small)
    assert small.feeds == [] and small.full
    monkeypatch.setattr(segments, "CHUNK_NODES", 2)   # several sessions: each returns the outputs it computes
    chunked = KeptSamples(3)   # (histograms fetch every tensor: every part has a session)
    runner.collect_stats(from_proto(proto), feeds, kept=chunked, method="mse")
    assert chunked.names == names and len(chunked.feeds) == 3
    for got, want in zip(chunked.outputs, kept.outputs):
        for have, value in zip(got, want):
            np.testing.assert_allclose(have, value, rtol=1e-5, atol=1e-6)
    unbuilt = KeptSamples(3)   # min/max: a part that computes an output but measures nothing gets no
    runner.collect_stats(from_proto(proto), feeds, kept=unbuilt)   # session, so none are kept
    assert unbuilt.feeds == []


@pytest.mark.parametrize("method", ["minmax", "entropy"])
def test_a_one_session_model_runs_the_next_sample_ahead_with_the_same_statistics(monkeypatch, method):
    """The next sample runs in onnxruntime while this one's statistics are taken: the same counts
    as running each sample in turn, and a sample onnxruntime rejects is still the one named."""
    from qpasses.errors import CalibrationDataError

    proto = _layered()
    feeds = [random_feed(proto, seed=s) for s in range(5)]
    threads = []
    run = segments.Part.run
    monkeypatch.setattr(segments.Part, "run", lambda self, env: threads.append(threading.current_thread()) or run(self, env))
    ahead, count = runner.collect_stats(from_proto(proto), feeds, method=method)
    assert count == 5 and len(threads) == 5 and threading.main_thread() not in threads
    monkeypatch.setattr(runner, "_run_ahead", lambda segs, fs: ((i, f, dict(f), None) for i, f in fs))
    inline, _ = runner.collect_stats(from_proto(proto), feeds, method=method)
    assert len(threads) == 10 and threads[-1] is threading.main_thread()
    assert list(ahead) == list(inline)
    for name in inline:
        assert (ahead[name].min, ahead[name].max, ahead[name].samples) == (inline[name].min, inline[name].max,
                                                                           inline[name].samples)
        if method == "entropy":
            assert np.array_equal(ahead[name].hist.counts, inline[name].hist.counts)
    monkeypatch.undo()
    feeds[3]["x2"] = np.ones((1, WIDTH + 1), np.float32)
    with pytest.raises(CalibrationDataError, match="sample 3"):
        runner.collect_stats(from_proto(proto), feeds, method=method)
