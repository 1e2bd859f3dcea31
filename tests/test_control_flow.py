"""If/Loop/Scan: the main graph is quantized, subgraphs are left float or quantized, never broken.

Each model has quantizable MatMuls before and after the control-flow node, and subgraphs that read
outer-scope tensors implicitly: an activation of the main graph and an initializer that the main
graph also reads as a weight (the case most likely to break when weights are replaced by their
quantized copies). Every output must pass onnx.checker, run in onnxruntime and stay close to the
float model; the main graph must hold Q/DQ nodes.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qpasses
from qpasses.evaluate import snr_db
from qpasses.testing import run

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


MODELS = {"If": if_model, "Loop": loop_model, "Scan": scan_model, "If-versioned-op": if_versioned_model}


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("config", [None, {"per_channel": True, "activation_type": "uint16", "weight_type": "int16"}],
                         ids=["default", "per-channel-16bit"])
def test_main_graph_quantized_subgraphs_intact(kind, config, tmp_path):
    model = MODELS[kind]()
    before = model.SerializeToString()
    feeds = _feeds(model, 16, 1)
    q = qpasses.quantize(model, feeds, config)
    assert model.SerializeToString() == before, "the input ModelProto was modified"
    path = qpasses.save(q, tmp_path / "q.onnx")
    out = onnx.load(str(path))
    onnx.checker.check_model(out, full_check=True)

    ops = [n.op_type for n in out.graph.node]
    assert ops.count("DequantizeLinear") >= 3 and "QuantizeLinear" in ops, ops
    assert ops.count(kind.split("-")[0]) == 1
    # subgraphs: untouched, or quantized (same ops plus Q/DQ, or reading an outer dequantized weight),
    # or converted to a newer opset (plus Constant nodes for attributes that became inputs)
    original = {(n, a): g for n, a, g in _subgraphs(model.graph)}
    for node, attr, sub in _subgraphs(out.graph):
        assert (node, attr) in original, f"subgraph {node}.{attr} appeared"
        kept = [n.op_type for n in sub.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear", "Constant")]
        assert kept == [n.op_type for n in original[(node, attr)].node], f"{node}.{attr} lost nodes"
    _assert_outer_reads_sorted(out.graph)

    refs, gots = [], []
    for feed in feeds:  # the calibration samples: no clipping, so the error is the rounding only
        ref, got = run(model, feed), run(out, feed)
        assert [a.shape for a in ref] == [b.shape for b in got]
        refs.append(np.concatenate([a.ravel() for a in ref]))
        gots.append(np.concatenate([b.ravel() for b in got]))
    # a broken graph gives ~0 dB; 8 bits on these tiny tensors give 30-40 dB, 16 bits 60-90
    assert snr_db(np.concatenate(refs), np.concatenate(gots)) > (25 if config is None else 55)


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
