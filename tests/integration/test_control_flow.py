"""If/Loop/Scan: the main graph and the weighted ops inside the bodies are quantized, never broken.

Each model has quantizable MatMuls before and after the control-flow node, and subgraphs that read
outer-scope tensors implicitly: an activation of the main graph and an initializer that the main
graph also reads as a weight (the case most likely to break when weights are replaced by their
quantized copies). Every output must pass onnx.checker, run in onnxruntime and stay close to the
float model; the main graph and every body holding a weighted op must hold Q/DQ nodes, and
onnxruntime must run those weighted ops as integer kernels (a body's DQ sits in the body).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qpasses
from qpasses.analysis.scopes import scopes
from qpasses.calibration.ranges import RANGE_BITS, outward
from qpasses.cli import main
from qpasses.cli.explain import explain_lines
from qpasses.core.context import RunContext
from qpasses.core.pipeline import QUANTIZE_PIPELINE, parse_pipeline
from qpasses.core.verify import check_structure
from qpasses.errors import ModelError
from qpasses.evaluation.evaluate import judging_session, snr_db
from qpasses.evaluation.summary import summary_line, weighted_ops
from qpasses.ir.decisions import float_reasons
from qpasses.ir.model import from_proto, load
from qpasses.testing import run, run_passes

F = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _w(name, *shape):
    return numpy_helper.from_array(RNG.normal(0, 0.5, shape).astype(np.float32), name)


def _vi(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits, opset=17):
    model = helper.make_model(helper.make_graph(nodes, "cf", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


WEIGHTS = [_w("w1", 4, 4), _w("w2", 4, 4), _w("ws", 4, 4)]
HEAD = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu")]


def if_model():
    """y = MatMul(If(c, then: MatMul(r, ws) [ws also used outside], else: Sigmoid(r)), w2)."""
    then = helper.make_graph([helper.make_node("MatMul", ["r", "ws"], ["t"], name="then_mm")], "then", [],
                             [_vi("t", [1, 4])])
    other = helper.make_graph([helper.make_node("Sigmoid", ["r"], ["e"], name="else_sig")], "else", [],
                              [_vi("e", [1, 4])])
    nodes = HEAD + [
        helper.make_node("If", ["c"], ["branch"], name="if", then_branch=then, else_branch=other),
        helper.make_node("MatMul", ["branch", "w2"], ["m2"], name="mm2"),
        helper.make_node("MatMul", ["r", "ws"], ["side"], name="mm_side"),
        helper.make_node("Add", ["m2", "side"], ["y"], name="add")]
    return _model(nodes, [_vi("x", [1, 4]), _vi("c", [], TensorProto.BOOL)], [_vi("y", [1, 4])], WEIGHTS)


def loop_model():
    """Three iterations of v <- Relu(MatMul(v, ws)) + r, plus a scan output; ws also used outside."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["v_in", "ws"], ["v_mm"], name="body_mm"),
         helper.make_node("Relu", ["v_mm"], ["v_relu"], name="body_relu"),
         helper.make_node("Add", ["v_relu", "r"], ["v_out"], name="body_add"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
         helper.make_node("Identity", ["v_out"], ["scan_out"], name="body_scan")],
        "body", [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL), _vi("v_in", [1, 4])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("v_out", [1, 4]), _vi("scan_out", [1, 4])])
    inits = WEIGHTS + [numpy_helper.from_array(np.array(3, np.int64), "trips"),
                       numpy_helper.from_array(np.array(True), "true")]
    nodes = HEAD + [
        helper.make_node("Loop", ["trips", "true", "h"], ["v_final", "v_all"], name="loop", body=body),
        helper.make_node("MatMul", ["v_final", "w2"], ["m2"], name="mm2"),
        helper.make_node("MatMul", ["r", "ws"], ["side"], name="mm_side"),
        helper.make_node("Add", ["m2", "side"], ["y"], name="add"),
        helper.make_node("ReduceMean", ["v_all"], ["y_all"], name="mean", axes=[0], keepdims=0)]
    return _model(nodes, [_vi("x", [1, 4])], [_vi("y", [1, 4]), _vi("y_all", [1, 4])], inits)


def scan_model():
    """A running sum over the rows of MatMul(x, w1), each step through MatMul(., ws); ws also outside."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["row", "ws"], ["row_mm"], name="body_mm"),
         helper.make_node("Add", ["s_in", "row_mm"], ["s_out"], name="body_add"),
         helper.make_node("Relu", ["s_out"], ["step"], name="body_relu")],
        "body", [_vi("s_in", [4]), _vi("row", [4])], [_vi("s_out", [4]), _vi("step", [4])])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("ReduceMean", ["r"], ["s0"], name="init", axes=[0], keepdims=0),
             helper.make_node("Scan", ["s0", "r"], ["s_final", "steps"], name="scan", body=body,
                              num_scan_inputs=1),
             helper.make_node("MatMul", ["steps", "w2"], ["m2"], name="mm2"),
             helper.make_node("MatMul", ["r", "ws"], ["side"], name="mm_side"),
             helper.make_node("Add", ["m2", "side"], ["y"], name="add")]
    return _model(nodes, [_vi("x", [6, 4])], [_vi("y", [6, 4]), _vi("s_final", [4])], WEIGHTS)


def _feeds(model, n, seed):
    rng = np.random.default_rng(seed)
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input}
    out = []
    for i in range(n):
        if "audio" in shapes:   # vad_model: both sample rates, random recurrent state
            out.append({"audio": rng.normal(0, 1, shapes["audio"]).astype(np.float32),
                        "sr": np.array(16000 if i % 2 == 0 else 8000, np.int64),
                        "h": rng.normal(0, 0.5, shapes["h"]).astype(np.float32),
                        "c": rng.normal(0, 0.5, shapes["c"]).astype(np.float32)})
            continue
        feed = {"x": rng.normal(0, 1, shapes["x"]).astype(np.float32)}
        if "c" in shapes:
            feed["c"] = np.array(i % 2 == 0)
        out.append(feed)
    return out


def _subgraphs(graph: onnx.GraphProto):
    """(node name, attribute name, GraphProto) of every subgraph, recursively."""
    for node in graph.node:
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subs:
                yield node.name, attr.name, sub
                yield from _subgraphs(sub)


def _outer_reads(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from enclosing scopes."""
    bound = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    reads = set()
    for node in graph.node:
        reads.update(n for n in node.input if n and n not in bound)
        for _, _, sub in _subgraphs(onnx.helper.make_graph([node], "n", [], [])):
            reads.update(_outer_reads(sub) - bound)
        bound.update(node.output)
    return reads


def _assert_outer_reads_sorted(graph: onnx.GraphProto) -> None:
    """Every tensor a node reads, explicitly or through its subgraphs, exists before that node."""
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        wanted = set(filter(None, node.input))
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                wanted |= _outer_reads(sub)
        missing = wanted - available
        assert not missing, f"node '{node.name}' reads {sorted(missing)} before they are produced"
        available.update(node.output)


def if_versioned_model():
    """An If whose branch holds ReduceMean(axes attribute): a 16-bit config raises the opset to 21,
    where axes is an input, so the subgraph must be converted too."""
    then = helper.make_graph([helper.make_node("ReduceMean", ["r"], ["t"], name="then_mean", axes=[1]),
                              helper.make_node("Expand", ["t", "shape"], ["t2"], name="then_expand")],
                             "then", [], [_vi("t2", [1, 4])])
    other = helper.make_graph([helper.make_node("Sigmoid", ["r"], ["e"], name="else_sig")], "else", [],
                              [_vi("e", [1, 4])])
    nodes = HEAD + [helper.make_node("If", ["c"], ["branch"], name="if", then_branch=then, else_branch=other),
                    helper.make_node("MatMul", ["branch", "w2"], ["y"], name="mm2")]
    shape = numpy_helper.from_array(np.array([1, 4], np.int64), "shape")
    return _model(nodes, [_vi("x", [1, 4]), _vi("c", [], TensorProto.BOOL)], [_vi("y", [1, 4])],
                  WEIGHTS[:2] + [shape])


def if_conv_matmul_model():
    """An If whose then branch holds a Conv and whose else branch holds a MatMul, both on the outer
    x, each with its own weights (initializers of the branch)."""
    conv_w = numpy_helper.from_array(RNG.normal(0, 0.5, (4, 4, 1)).astype(np.float32), "conv_w")
    conv_b = numpy_helper.from_array(RNG.normal(0, 0.1, (4,)).astype(np.float32), "conv_b")
    mm_w = numpy_helper.from_array(RNG.normal(0, 0.5, (4, 4)).astype(np.float32), "mm_w")
    then = helper.make_graph(
        [helper.make_node("Reshape", ["r", "as_ncl"], ["r3"], name="then_reshape"),
         helper.make_node("Conv", ["r3", "conv_w", "conv_b"], ["t3"], name="then_conv"),
         helper.make_node("Reshape", ["t3", "as_nc"], ["t"], name="then_flat")],
        "then", [], [_vi("t", [1, 4])], [conv_w, conv_b])
    other = helper.make_graph([helper.make_node("MatMul", ["r", "mm_w"], ["e"], name="else_mm")], "else", [],
                              [_vi("e", [1, 4])], [mm_w])
    shapes = [numpy_helper.from_array(np.array([1, 4, 1], np.int64), "as_ncl"),
              numpy_helper.from_array(np.array([1, 4], np.int64), "as_nc")]
    nodes = HEAD + [helper.make_node("If", ["c"], ["branch"], name="if", then_branch=then, else_branch=other),
                    helper.make_node("MatMul", ["branch", "w2"], ["y"], name="mm2")]
    return _model(nodes, [_vi("x", [1, 4]), _vi("c", [], TensorProto.BOOL)], [_vi("y", [1, 4])],
                  WEIGHTS[:2] + shapes)


def vad_model(hidden=16, channels=16, samples=64):
    """A voice-activity model: all compute sits in the two branches of an If on the sample-rate
    input (as in Silero VAD): a strided Conv "STFT", |.|, Conv+Relu, an LSTM started from the
    state inputs h and c (outer scope), a MatMul decoder and Sigmoid; new state as outputs."""
    rng = np.random.default_rng(3)

    def w(name, *shape, scale=None):
        fan_in = int(np.prod(shape[1:]))
        return numpy_helper.from_array(rng.normal(0, scale or 1 / np.sqrt(fan_in), shape).astype(np.float32), name)

    def branch(p, kernel, stride):
        inits = [w(p + "stft", channels, 1, kernel), w(p + "enc_w", channels, channels, 3),
                 numpy_helper.from_array(rng.normal(0, 0.1, channels).astype(np.float32), p + "enc_b"),
                 w(p + "lstm_W", 1, 4 * hidden, channels), w(p + "lstm_R", 1, 4 * hidden, hidden),
                 numpy_helper.from_array(rng.normal(0, 0.1, (1, 8 * hidden)).astype(np.float32), p + "lstm_B"),
                 w(p + "dec_w", hidden, 1, scale=0.5)]
        nodes = [
            helper.make_node("Conv", ["audio", p + "stft"], [p + "spec"], name=p + "stft_conv", strides=[stride]),
            helper.make_node("Abs", [p + "spec"], [p + "mag"], name=p + "abs"),
            helper.make_node("Conv", [p + "mag", p + "enc_w", p + "enc_b"], [p + "enc"], name=p + "enc_conv",
                             pads=[1, 1]),
            helper.make_node("Relu", [p + "enc"], [p + "enc_r"], name=p + "enc_relu"),
            helper.make_node("Transpose", [p + "enc_r"], [p + "seq"], name=p + "to_seq", perm=[2, 0, 1]),
            helper.make_node("LSTM", [p + "seq", p + "lstm_W", p + "lstm_R", p + "lstm_B", "", "h", "c"],
                             [p + "Y", p + "hn", p + "cn"], name=p + "lstm", hidden_size=hidden),
            helper.make_node("Squeeze", [p + "Y", "axis1"], [p + "y2"], name=p + "squeeze"),
            helper.make_node("MatMul", [p + "y2", p + "dec_w"], [p + "logit"], name=p + "decoder"),
            helper.make_node("Sigmoid", [p + "logit"], [p + "p"], name=p + "sigmoid"),
            helper.make_node("ReduceMean", [p + "p"], [p + "prob"], name=p + "mean", axes=[0], keepdims=0)]
        outs = [_vi(p + "prob", [1, 1]), _vi(p + "hn", [1, 1, hidden]), _vi(p + "cn", [1, 1, hidden])]
        return helper.make_graph(nodes, p + "branch", [], outs, inits)

    nodes = [helper.make_node("Equal", ["sr", "sr16k"], ["is16k"], name="is_16k"),
             helper.make_node("If", ["is16k"], ["prob", "hn", "cn"], name="sr_branch",
                              then_branch=branch("k16_", 8, 4), else_branch=branch("k8_", 4, 2))]
    inits = [numpy_helper.from_array(np.array(16000, np.int64), "sr16k"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    return _model(nodes, [_vi("audio", [1, 1, samples]), _vi("sr", [], TensorProto.INT64),
                          _vi("h", [1, 1, hidden]), _vi("c", [1, 1, hidden])],
                  [_vi("prob", [1, 1]), _vi("hn", [1, 1, hidden]), _vi("cn", [1, 1, hidden])], inits, opset=13)


MODELS = {"If": if_model, "Loop": loop_model, "Scan": scan_model, "If-versioned-op": if_versioned_model,
          "If-conv-matmul": if_conv_matmul_model, "VAD": vad_model}
CONTROL_FLOW = {"If": "If", "Loop": "Loop", "Scan": "Scan", "If-versioned-op": "If", "If-conv-matmul": "If",
                "VAD": "If"}
WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")
SIXTEEN_BIT = {"per_channel": True, "activation_type": "uint16", "weight_type": "int16"}


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in graph.node for o in n.output}


def _snr(model, out, feeds) -> float:
    """The output SNR of ``out`` in onnxruntime's QDQ simulation (the same on every CPU)."""
    refs, gots, simulated = [], [], judging_session(out)
    for feed in feeds:
        ref, got = run(model, feed), simulated.run(None, feed)
        assert [a.shape for a in ref] == [b.shape for b in got]
        refs.append(np.concatenate([a.ravel() for a in ref]))
        gots.append(np.concatenate([b.ravel() for b in got]))
    return snr_db(np.concatenate(refs), np.concatenate(gots))


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("config", [None, SIXTEEN_BIT], ids=["default", "per-channel-16bit"])
def test_weighted_ops_in_bodies_get_qdq_in_their_own_graph(kind, config, tmp_path):
    model = MODELS[kind]()
    before = model.SerializeToString()
    feeds = _feeds(model, 16, 1)
    q = qpasses.quantize(model, feeds, config)
    assert model.SerializeToString() == before, "the input ModelProto was modified"
    out = onnx.load(str(qpasses.save(q, tmp_path / "q.onnx")))
    onnx.checker.check_model(out, full_check=True)

    ops = [n.op_type for n in out.graph.node]
    every = ops + [n.op_type for _, _, sub in _subgraphs(out.graph) for n in sub.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in every, ops   # VAD: its DQs sit in the bodies
    assert ops.count(CONTROL_FLOW[kind]) == 1
    # subgraphs: the same ops plus Q/DQ (a Relu/Clip may be merged into its producer's Q), or
    # converted to a newer opset (plus Constant nodes for attributes that became inputs)
    original = {(n, a): g for n, a, g in _subgraphs(model.graph)}
    extra = ("QuantizeLinear", "DequantizeLinear", "Constant")
    for node, attr, sub in _subgraphs(out.graph):
        assert (node, attr) in original, f"subgraph {node}.{attr} appeared"
        kept = [n.op_type for n in sub.node if n.op_type not in extra]
        before_ops = [n.op_type for n in original[(node, attr)].node]
        assert [o for o in kept if o not in ("Relu", "Clip")] == [o for o in before_ops if o not in ("Relu", "Clip")], \
            f"{node}.{attr} lost nodes"
        # every weighted op of a body reads its data and weight from a DQ of its own graph
        producer = _producers(sub)
        for n in sub.node:
            if n.op_type in WEIGHTED:
                for i in (0, 1):
                    source = producer.get(n.input[i])
                    assert source is not None and source.op_type == "DequantizeLinear", \
                        f"{node}.{attr}: {n.op_type} '{n.name}' input {i} ('{n.input[i]}') is not dequantized in its body"
    _assert_outer_reads_sorted(out.graph)
    # the calibration samples: no clipping, so the error is the rounding only; a broken graph
    # gives ~0 dB; 8 bits on these tiny tensors give 30-60 dB, 16 bits 60-90
    assert _snr(model, out, feeds) > (25 if config is None else 55)


def _optimized_bodies(proto: onnx.ModelProto, tmp_path) -> dict[str, list[str]]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED   # fusions, no layout pass
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    optimized = onnx.load(opts.optimized_model_filepath)
    return {f"{n}.{a}": [x.op_type for x in g.node] for n, a, g in _subgraphs(optimized.graph)}


@pytest.mark.parametrize("kind", ["If", "Loop", "Scan", "If-conv-matmul", "VAD"])
def test_onnxruntime_runs_the_body_weighted_ops_as_integer_kernels(kind, tmp_path):
    model = MODELS[kind]()
    q = qpasses.quantize(model, _feeds(model, 16, 1))
    bodies = _optimized_bodies(q.to_proto(), tmp_path)
    assert bodies
    for where, ops in bodies.items():
        assert not set(WEIGHTED) & set(ops), f"{where} still runs float {sorted(set(WEIGHTED) & set(ops))}: {ops}"
    fused = [op for ops in bodies.values() for op in ops if op.startswith("QLinear")]
    assert len(fused) >= (4 if kind == "VAD" else 1), bodies


def test_vad_model_all_weighted_ops_8_bit_lstm_float():
    model = vad_model()
    q = qpasses.quantize(model, _feeds(model, 16, 1))
    proto = q.to_proto(metadata=False)
    assert weighted_ops(proto) == (6, 6)   # 2 x (STFT Conv, encoder Conv, decoder MatMul)
    assert summary_line(proto, float_reasons(q)).startswith("8-bit: 100 % of weighted ops (6 of 6)")
    for p in ("k16_", "k8_"):   # no rule for LSTM: it reads and writes float, with the reason
        # the STFT weight: 8-bit, on a grid its int8 pair sums cannot saturate on (protect-pair-sums)
        assert q.quant[p + "stft"].qtype == "int8" and q.decisions["pair_sums"]["layers"][p + "stft"]["fix"] == "grid"
        assert "no quantization rule for LSTM" in float_reasons(q)[p + "hn"]["reason"]
    lines = "\n".join(explain_lines(q, "k8_spec"))
    assert "inside the else_branch of If 'sr_branch'" in lines and "output of Conv 'k8_stft_conv'" in lines


def _loop_reference(x, w1, ws):
    r = np.maximum(x @ w1, 0)
    v, seen = x @ w1, {"v_in": [], "v_mm": [], "v_relu": [], "v_out": []}
    for _ in range(3):
        seen["v_in"].append(v)
        mm = v @ ws
        seen["v_mm"].append(mm)
        seen["v_relu"].append(np.maximum(mm, 0))
        v = np.maximum(mm, 0) + r
        seen["v_out"].append(v)
    return seen


@pytest.mark.parametrize("method", ["minmax", "percentile"])
def test_body_tensors_are_calibrated_through_the_outer_runs(method):
    """The observed min/max of body tensors are those of the values the bodies computed: If
    branches only on the samples that took them, every Loop iteration (min/max: scalars
    threaded out as scan outputs; histograms: values in a loop-carried sequence)."""
    weights = {t.name: numpy_helper.to_array(t) for t in WEIGHTS}
    for build in (if_model, loop_model):
        model = build()
        feeds = _feeds(model, 6, 2)
        q = from_proto(model)
        run_passes(f"calibrate{{method={method}}}", q, data=feeds)
        if build is if_model:   # then branch: t = MatMul(r, ws) on the samples with c = True
            expected = {"t": [np.maximum(f["x"] @ weights["w1"], 0) @ weights["ws"] for f in feeds if f["c"]]}
        else:
            expected = {}
            for f in feeds:
                for k, v in _loop_reference(f["x"], weights["w1"], weights["ws"]).items():
                    expected.setdefault(k, []).extend(v)
        for name, values in expected.items():
            values = np.concatenate([np.ravel(v) for v in values])
            # kept to RANGE_BITS significant bits, outward: numpy's last bits may round one step apart
            want = outward(float(values.min()), float(values.max()))
            np.testing.assert_allclose(q.observed[name], want, rtol=2.0**-RANGE_BITS, atol=1e-6)
            assert name in q.ranges


def test_a_branch_that_never_ran_during_calibration_stays_float_with_its_reason():
    model = if_conv_matmul_model()
    feeds = [{**f, "c": np.array(True)} for f in _feeds(model, 8, 1)]   # the else branch never runs
    q = qpasses.quantize(model, feeds)
    assert "e" not in q.quant and "t" in q.quant
    assert "did not run on the calibration data" in float_reasons(q)["e"]["reason"]
    assert q.decisions["calibration"]["unobserved"] == ["e"]
    proto = q.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    assert _snr(model, proto, feeds) > 25
    # the else branch computes in float; the If output's grid, calibrated on the then branch only, clips
    assert _snr(model, proto, [{**f, "c": np.array(False)} for f in feeds]) > 5


def clashing_model():
    """Both branches of an If name their MatMul output 't' (legal: sibling bodies may reuse names)."""
    def branch(tag, weight):
        return helper.make_graph([helper.make_node("MatMul", ["r", weight], ["t"], name=f"{tag}_mm"),
                                  helper.make_node("Identity", ["t"], [f"{tag}_out"], name=f"{tag}_id")],
                                 tag, [], [_vi(f"{tag}_out", [1, 4])])
    nodes = HEAD + [helper.make_node("If", ["c"], ["branch"], name="if", then_branch=branch("then", "ws"),
                                     else_branch=branch("else", "w2")),
                    helper.make_node("MatMul", ["branch", "w2"], ["y"], name="mm2")]
    return _model(nodes, [_vi("x", [1, 4]), _vi("c", [], TensorProto.BOOL)], [_vi("y", [1, 4])], WEIGHTS)


def test_a_name_defined_in_two_bodies_stays_float_with_its_reason(tmp_path):
    """The key scheme (qpasses.analysis.scopes): the table is keyed by tensor name, so a name two
    bodies define is ambiguous: it gets no entry and its reason names both bodies; what the two
    MatMuls read (r, ws, w2) is still quantized."""
    model = clashing_model()
    feeds = _feeds(model, 16, 1)
    q = qpasses.quantize(model, feeds)
    assert "t" not in q.quant and {"r", "ws", "w2"} <= set(q.quant)
    reason = float_reasons(q)["t"]["reason"]
    assert "then_branch of If 'if'" in reason and "else_branch of If 'if'" in reason
    assert explain_lines(q, "t")[0] == "t: left float"
    out = onnx.load(str(qpasses.save(q, tmp_path / "q.onnx")))
    onnx.checker.check_model(out, full_check=True)
    assert _snr(model, out, feeds) > 25


def test_nothing_quantized_says_why():
    """All compute inside If bodies, none of it with a quantization rule (an LSTM): the summary
    counts the body nodes and gives the commonest reason instead of a silent 'identical'."""
    W = numpy_helper.from_array(RNG.normal(0, 0.3, (1, 16, 4)).astype(np.float32), "W")
    R = numpy_helper.from_array(RNG.normal(0, 0.3, (1, 16, 4)).astype(np.float32), "R")

    def branch(tag):
        return helper.make_graph([helper.make_node("LSTM", ["x", "W", "R"], [f"{tag}_y"], name=f"{tag}_lstm",
                                                   hidden_size=4)], tag, [], [_vi(f"{tag}_y", [2, 1, 1, 4])])
    nodes = [helper.make_node("If", ["c"], ["y"], name="if", then_branch=branch("a"), else_branch=branch("b"))]
    model = _model(nodes, [_vi("x", [2, 1, 4]), _vi("c", [], TensorProto.BOOL)], [_vi("y", [2, 1, 1, 4])], [W, R])
    feeds = [{"x": RNG.normal(0, 1, (2, 1, 4)).astype(np.float32), "c": np.array(i % 2 == 0)} for i in range(4)]
    q = qpasses.quantize(model, feeds)
    line = summary_line(q.to_proto(metadata=False), float_reasons(q))
    assert line.startswith("nothing quantized: 0 of 3 compute nodes (2 of them inside If/Loop/Scan bodies)"), line
    assert "no quantization rule for LSTM" in line, line


@pytest.mark.parametrize("kind", ["If", "Loop", "Scan", "VAD"])
def test_default_pipeline_with_verify_each_reload_changes_nothing(kind):
    """Every pass of QUANTIZE_PIPELINE on a model with bodies: facts and structure checked after each
    pass, on the reloaded model, which must give the same bytes as the plain run."""
    model = MODELS[kind]()
    feeds = _feeds(model, 12, 1)
    plain, _ = qpasses.run_pipeline(model, QUANTIZE_PIPELINE, ctx=RunContext({}, feeds))
    reloaded, _ = qpasses.run_pipeline(model, QUANTIZE_PIPELINE, ctx=RunContext({}, feeds), verify_each="reload")
    assert reloaded.to_proto().SerializeToString() == plain.to_proto().SerializeToString()
    assert any(n.op == "DequantizeLinear" for n, _ in scopes(plain).body_nodes())


@pytest.mark.slow
def test_resuming_after_any_pass_gives_the_same_bytes(tmp_path):
    model = vad_model()
    feeds = _feeds(model, 12, 1)
    whole, _ = qpasses.run_pipeline(model, QUANTIZE_PIPELINE, ctx=RunContext({}, feeds))
    passes = [p.text() for p in parse_pipeline(QUANTIZE_PIPELINE)]
    for k in range(1, len(passes)):
        first, _ = qpasses.run_pipeline(model, ",".join(passes[:k]), ctx=RunContext({}, feeds))
        qpasses.save(first, tmp_path / "cut.onnx")
        resumed, _ = qpasses.run_pipeline(load(tmp_path / "cut.onnx"), ",".join(passes[k:]), ctx=RunContext({}, feeds))
        assert resumed.to_proto().SerializeToString() == whole.to_proto().SerializeToString(), \
            f"resuming after {passes[k - 1]} differs"


def test_cli_run_and_explain_show_body_tensors(tmp_path, capsys):
    model = vad_model()
    onnx.save(model, tmp_path / "vad.onnx")
    feeds = _feeds(model, 8, 1)
    np.savez(tmp_path / "calib.npz", **{k: np.stack([f[k] for f in feeds]) for k in feeds[0]})
    code = main(["run", str(tmp_path / "vad.onnx"), "-o", str(tmp_path / "q.onnx"), "--calib",
                 str(tmp_path / "calib.npz"), "--verify-each", "reload"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "8-bit: 100 % of weighted ops (6 of 6)" in captured.err + captured.out
    assert main(["explain", str(tmp_path / "q.onnx"), "--tensor", "k16_enc"]) == 0
    shown = capsys.readouterr().out
    assert "inside the then_branch of If 'sr_branch'" in shown and "Conv 'k16_enc_conv'" in shown


def test_structure_check_sees_into_bodies():
    """verify: a body reading a tensor its enclosing graph produces only after the If is refused."""
    q = from_proto(if_model())
    check_structure(q)
    if_node = next(n for n in q.graph.nodes if n.op == "If")
    late = next(n for n in q.graph.nodes if n.name == "mm_side").outputs[0]
    then = if_node.attrs["then_branch"]
    then.nodes[0].inputs[0] = late
    with pytest.raises(ModelError, match="in the then_branch of If 'if' reads 'side'"):
        check_structure(q)


@pytest.mark.parametrize("kind", MODELS)
def test_without_calibration_only_float_passes(kind, tmp_path):
    """The float pipeline (fold-constants, fold-batchnorm, cleanup) keeps control flow working."""
    model = MODELS[kind]()
    q, _ = qpasses.run_pipeline(model)
    out = onnx.load(str(qpasses.save(q, tmp_path / "f.onnx")))
    onnx.checker.check_model(out, full_check=True)
    for feed in _feeds(model, 2, 3):
        for a, b in zip(run(model, feed), run(out, feed), strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
