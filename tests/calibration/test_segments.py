"""The segmented onnxruntime executor (qpasses.calibration.segments): a model run as a chain of
sessions computes what one session computes, offers each tensor to ``extend`` once, and hands
weights over as arrays; evaluate.Reference and correct-bias use it for big models."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qpasses.api import run_pipeline
from qpasses.calibration import segments
from qpasses.core.context import RunContext
from qpasses.evaluation.evaluate import Reference
from qpasses.ir.model import from_proto
from qpasses.testing import parse, random_feed

# a chain with what cuts must carry: a value read many nodes later, a second graph input read
# late, a graph output also read inside the graph, one nobody reads, and a graph input passed through
CHAIN = """
g (float[1, 8] x, float[1, 8] x2) => (float[1, 8] y, float[1, 8] early, float[1, 8] h1, float[1, 8] x2) <float[8, 8] w = {%s}> {
    a0 = Relu(x)
    early = Sigmoid(a0)
%s
    late = Mul(h%d, x2)
    y = Add(late, a0)
}
"""


def _chain(blocks: int = 6):
    weights = ", ".join(f"{v:.3f}" for v in np.random.default_rng(0).uniform(-0.4, 0.4, 64))
    body, prev = [], "a0"
    for i in range(blocks):
        body += [f"    m{i} = MatMul({prev}, w)", f"    t{i} = Tanh(m{i})", f"    h{i} = Add(t{i}, {prev})"]
        prev = f"h{i}"
    return parse(CHAIN % (weights, "\n".join(body), blocks - 1))


def _plain(proto, names, feed):
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(names, feed)


def test_a_chain_of_sessions_computes_what_one_session_computes(monkeypatch):
    proto = _chain()
    monkeypatch.setattr(segments, "CHUNK_NODES", 3)
    sess = segments.SegmentedSession(from_proto(proto))
    assert len(sess.parts) > 3
    assert sess.output_names == ["y", "early", "h1", "x2"] and [s.name for s in sess.specs] == ["x", "x2"]
    for seed in range(3):
        feed = random_feed(proto, seed=seed)
        got = sess.run(sess.output_names, feed)
        for name, want, have in zip(sess.output_names, _plain(proto, sess.output_names, feed), got):
            np.testing.assert_allclose(have, want, rtol=1e-6, atol=1e-7, err_msg=name)
        np.testing.assert_array_equal(got[-1], feed["x2"])   # a graph input passed through


def test_extend_is_offered_each_tensor_once_in_the_first_part_that_has_it(monkeypatch):
    proto = _chain()
    monkeypatch.setattr(segments, "CHUNK_NODES", 3)
    offered = []

    def expose(part, available):
        offered.extend(available)
        names = sorted(n for n in available if n.startswith("m"))
        part.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names
                                 if n not in {o.name for o in part.graph.output})
        return names

    sess = segments.SegmentedSession(from_proto(proto), extend=expose, graph_outputs=False)
    assert len(offered) == len(set(offered)) and "w" not in offered
    assert set(offered) == {"x", "x2"} | {o for n in proto.graph.node for o in n.output}
    assert sess.output_names == []
    names = [f"m{i}" for i in range(6)]
    feed = random_feed(proto, seed=1)
    full = from_proto(proto).to_proto()
    full.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names)
    for want, have in zip(_plain(full, names, feed), sess.run(names, feed)):
        np.testing.assert_allclose(have, want, rtol=1e-6, atol=1e-7)


def _wide(width: int = 256):
    """Gemm + MatMul layers with weights above the 1 KiB from which they are handed over as arrays
    (wide enough that onnxruntime rounds differently without prepacked weights)."""
    w = numpy_helper.from_array(np.random.default_rng(0).uniform(-0.3, 0.3, (width, width)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["g1"], transB=1), helper.make_node("Relu", ["g1"], ["r"]),
         helper.make_node("MatMul", ["r", "w"], ["y"])], "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, width])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_weights_handed_over_as_arrays_give_the_plain_session_s_outputs(monkeypatch):
    proto = _wide()
    monkeypatch.setattr(segments, "IN_MEMORY_BYTES", 1)
    sess = segments.SegmentedSession(from_proto(proto))
    assert len(sess.parts) == 1 and sess.parts[0][0].keep   # one session, weights as OrtValues
    feed = random_feed(proto, seed=2)
    for want, have in zip(_plain(proto, sess.output_names, feed), sess.run(sess.output_names, feed)):
        np.testing.assert_array_equal(have, want)


def test_nothing_to_fetch_builds_no_session():
    sess = segments.SegmentedSession(from_proto(_chain()), graph_outputs=False)
    assert sess.parts == [] and [s.name for s in sess.specs] == ["x", "x2"]


@pytest.mark.parametrize("setting", [{"CHUNK_NODES": 3}, {"IN_MEMORY_BYTES": 1}])
def test_reference_of_a_big_model_runs_segmented(monkeypatch, setting):
    proto = _chain()
    feeds = [random_feed(proto, seed=s) for s in range(3)]
    plain = Reference.run(proto, feeds)
    for key, value in setting.items():
        monkeypatch.setattr(segments, key, value)
    built = []
    real = segments.SegmentedSession.__init__
    monkeypatch.setattr(segments.SegmentedSession, "__init__", lambda self, *a, **k: built.append(1) or real(self, *a, **k))
    big = Reference.run(from_proto(proto), feeds)
    assert built and big.names == plain.names and big.inputs == plain.inputs == ["x", "x2"]
    for name in plain.names:
        np.testing.assert_allclose(big.outputs[name], plain.outputs[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert Reference.run(from_proto(proto), feeds, max_samples=2).feeds == feeds[:2]


DEPTHWISE_STACK = """
g (float[1, 2, 8, 8] x) => (float[1, 2, 8, 8] y)
<float[2, 1, 3, 3] w = {0.44, -2.08, 0.41, -1.91, -3.92, -1.62, 1.49, 5.98, 1.22,
                        0.035, -0.058, 0.016, -0.0017, 0.62, 0.031, -0.021, 0.37, -0.136},
 float[2] b = {1.5, -0.7}, float[2] b2 = {0.3, 0.2}, float[2] b3 = {-0.1, 0.4}, float[2, 1, 1, 1] k = {0.5, 2}>
{
    c1 = Conv <group = 2, pads = [1, 1, 1, 1]> (x, w, b)
    s1 = Mul(c1, k)
    c2 = Conv <group = 2, pads = [1, 1, 1, 1]> (s1, w, b2)
    r2 = Relu(c2)
    s2 = Add(r2, s1)
    y = Conv <group = 2, pads = [1, 1, 1, 1]> (s2, w, b3)
}
"""


def test_correct_bias_over_a_chain_of_sessions_corrects_like_one_session(monkeypatch):
    config = {"activation_type": "uint16", "weight_type": "int8", "per_channel": False}
    rng = np.random.default_rng(0)
    feeds = [{"x": (rng.standard_normal((1, 2, 8, 8)) + np.array([20, -30]).reshape(1, 2, 1, 1)).astype(np.float32)}
             for _ in range(8)]
    passes = "annotate-types,calibrate,compute-qparams,correct-bias"

    def corrected():
        ctx = RunContext(config, feeds)
        model, _ = run_pipeline(from_proto(parse(DEPTHWISE_STACK)), passes, ctx=ctx)
        assert ctx.findings.as_dict()["correct-bias"]["layers"] == 3
        return {n: np.asarray(model.tensors()[n].values) for n in ("b", "b2", "b3")}

    one = corrected()
    monkeypatch.setattr(segments, "CHUNK_NODES", 2)   # the probes land in the parts computing their inputs
    parts = []
    real = segments.SegmentedModel.build
    monkeypatch.setattr(segments.SegmentedModel, "build", lambda self, k, *a, **kw: parts.append(k) or real(self, k, *a, **kw))
    many = corrected()
    assert max(parts) >= 2
    for name in one:
        np.testing.assert_allclose(many[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)
