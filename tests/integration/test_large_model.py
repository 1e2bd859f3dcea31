"""Large models: calibration over a chain of onnxruntime sessions, and the external-data path
(load -> quantize -> save) through the full default pipeline."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gc

import onnx_graphsurgeon as gs

import qpasses
from qpasses import ModelError
from qpasses.analysis.dtypes import infer_types
from qpasses.calibration import runner, segments
from qpasses.core import pipeline
from qpasses.core.verify import check_onnx
from qpasses.ir import model as ir
from qpasses.ir.model import from_proto
from qpasses.testing import parse, random_feed, run

# A deep graph with what a cut must respect: a sequence value live over many nodes (no cut while
# it is live), an If branch reading an outer-scope value, a second graph input read late, a graph
# output nobody reads, a shared weight, and a tensor large enough for ReduceMin/ReduceMax nodes.
CHAIN = """
g (float[1, 8] x, float[1, 8] x2) => (float[1, 8] y, float[1, 8] early, float[2, 8] joined) <float[8, 8] w = {%s},
        int64[2] reps = {1, 1024}, bool flag = {1}> {
    a0 = Relu(x)
    early = Sigmoid(a0)
    seq = SequenceConstruct(a0, x2)
%s
    big = Tile(h%d, reps)
    bigr = Relu(big)
    y = If(flag) <then_branch = t () => (float[1, 8] o) { o = Mul(h%d, x2) },
                  else_branch = e () => (float[1, 8] o2) { o2 = Neg(h%d) }>
}
"""


def _chain_model(blocks: int = 12):
    weights = ", ".join(f"{v:.3f}" for v in np.random.default_rng(0).uniform(-0.4, 0.4, 64))
    body, prev = [], "a0"
    for i in range(blocks):
        body += [f"    m{i} = MatMul({prev}, w)", f"    t{i} = Tanh(m{i})", f"    h{i} = Add(t{i}, {prev})"]
        prev = f"h{i}"
        if i == 2:
            body.append("    joined = ConcatFromSequence <axis = 0> (seq)")
    last = blocks - 1
    return parse(CHAIN % (weights, "\n".join(body), last, last, last))


@pytest.mark.parametrize("method", ["minmax", "entropy"])
def test_chained_sessions_measure_what_one_session_measures(monkeypatch, method):
    proto = _chain_model()
    feeds = [random_feed(proto, seed=s) for s in range(3)]
    one, _ = runner.collect_stats(from_proto(proto), feeds, method=method)
    monkeypatch.setattr(segments, "CHUNK_NODES", 4)
    plan = runner._Plan(from_proto(proto), method != "minmax")
    assert len(plan.segments) > 3
    many, _ = runner.collect_stats(from_proto(proto), feeds, method=method)
    assert list(many) == list(one) and "bigr" in many and "joined" in many
    for name in one:
        np.testing.assert_allclose(many[name].observed, one[name].observed, rtol=1e-6, err_msg=name)
    if method == "entropy":
        assert all(many[n].hist.total == one[n].hist.total for n in one)


def test_a_sequence_value_is_never_cut(monkeypatch):
    monkeypatch.setattr(segments, "CHUNK_NODES", 2)
    proto = _chain_model(3)
    model = from_proto(proto)
    chain = segments.Chain(model, model.to_proto(), infer_types(model.to_proto())[0])
    names = [n.name or n.output[0] for n in proto.graph.node]
    seq_at = next(i for i, n in enumerate(proto.graph.node) if n.op_type == "SequenceConstruct")
    read_at = next(i for i, n in enumerate(proto.graph.node) if n.op_type == "ConcatFromSequence")
    cuts = [s.start for s in chain.spans[1:]]
    assert len(cuts) >= 1, names
    assert not any(seq_at < c <= read_at for c in cuts)



def test_sparse_histograms_count_what_dense_ones_count(monkeypatch):
    """Histograms of small tensors keep (bin, count) pairs: same grid and counts as dense ones."""
    from qpasses.calibration import collectors

    rng = np.random.default_rng(1)
    parts = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4) + rng.integers(-5, 5)).astype(np.float32)
             for n in (5, 64, 300, 1, 700, 64, 2000, 64, 5000, 64)]
    sparse, dense = collectors.Histogram(8192), collectors.Histogram(8192)
    for i, part in enumerate(parts):
        monkeypatch.setattr(collectors, "SPARSE_BINS", 1024)
        sparse.add(part)
        monkeypatch.setattr(collectors, "SPARSE_BINS", 0)
        dense.add(part)
        assert (sparse.exponent, sparse.offset, sparse.zeros) == (dense.exponent, dense.offset, dense.zeros)
        np.testing.assert_array_equal(sparse.counts, dense.counts)
        assert (sparse._dense is None) == (i < 8)
    assert sparse.total == sum(p.size for p in parts)


def _mlp(layers: int = 3, width: int = 64, seed: int = 0) -> onnx.ModelProto:
    """MatMul+Add+Relu layers: weights of width*width floats (16 KB at 64)."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits += [numpy_helper.from_array((rng.standard_normal((width, width)) / 8).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array((rng.standard_normal(width) / 8).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _save_external(proto: onnx.ModelProto, path) -> None:
    """Save with every tensor in one external data file (on a copy: save_model edits the proto)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    onnx.save_model(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=0)


def test_load_reads_external_data_into_arrays_and_keeps_no_reference_to_the_proto(tmp_path):
    """External data is read straight into numpy arrays and nothing points into the loaded
    proto (gs would keep all of it, weights included, alive through lazy values and opset lists)."""
    proto = _mlp()
    _save_external(proto, tmp_path / "m.onnx")
    model = qpasses.load(tmp_path / "m.onnx")
    constants = [t for t in model.tensors().values() if isinstance(t, gs.Constant)]
    assert len(constants) == 6 and all(isinstance(t._values, np.ndarray) for t in constants)
    assert all(t.data_location is None for t in constants)
    assert isinstance(model.graph.import_domains, list)
    feed = random_feed(proto)
    np.testing.assert_array_equal(run(model, feed)[0], run(proto, feed)[0])


def test_short_external_data_is_a_one_line_error(tmp_path):
    _save_external(_mlp(), tmp_path / "m.onnx")
    data = tmp_path / "m.onnx.data"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(ModelError, match=r"m.onnx: initializer 'b2': external data file 'm.onnx.data' ends before"):
        qpasses.load(tmp_path / "m.onnx")


@pytest.mark.parametrize("source", ["path", "proto"])
def test_to_proto_hands_big_weights_over_as_arrays(tmp_path, source):
    _save_external(_mlp(), tmp_path / "m.onnx")
    model = qpasses.load(tmp_path / "m.onnx") if source == "path" else from_proto(_mlp())
    before = {n: t._values for n, t in model.tensors().items() if isinstance(t, gs.Constant)}
    weights = {}
    proto = model.to_proto(metadata=False, weights=weights)
    assert sorted(weights) == ["w0", "w1", "w2"]          # biases (256 bytes) stay in the proto
    if source == "path":  # arrays: handed over as they are (from a proto: loaded from its lazy values)
        assert all(weights[n] is before[n] for n in weights)
    stubs = {t.name: t for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert sorted(stubs) == sorted(weights) and not any(t.raw_data for t in stubs.values())
    assert {e.key: e.value for e in stubs["w0"].external_data}["location"] == ir.IN_MEMORY
    assert all(t._values is before[n] for n, t in model.tensors().items() if isinstance(t, gs.Constant))


def test_replaced_weights_are_freed_after_each_pass(monkeypatch):
    """gs objects sit in reference cycles: the float weights insert-qdq replaces are freed by the
    collection the pass manager runs for models with big weights, not whenever gc gets to them."""
    monkeypatch.setattr(pipeline, "COLLECT_BYTES", 0)
    proto = _mlp()
    model = from_proto(proto)
    feeds = [random_feed(proto, seed=s) for s in range(4)]
    enabled = gc.isenabled()
    gc.disable()
    try:
        qpasses.quantize(model, feeds)
        floats = [o for o in gc.get_objects() if isinstance(o, gs.Constant) and o.name in ("w0", "w1", "w2")
                  and isinstance(o._values, np.ndarray) and o._values.dtype == np.float32]
    finally:
        if enabled:
            gc.enable()
    assert floats == []


@pytest.mark.slow
def test_external_data_model_through_the_default_pipeline(tmp_path, monkeypatch):
    """A small stand-in for a >2 GB model (tools/bench_big_model.py runs the real size): external
    data in, weights handed to onnxruntime as arrays for calibration, external data out."""
    monkeypatch.setattr(ir, "EXTERNAL_DATA_THRESHOLD", 64 * 1024)   # save decides external data itself
    monkeypatch.setattr(segments, "IN_MEMORY_BYTES", 1)             # the >2 GB calibration path
    proto = _mlp(layers=6, width=128)
    _save_external(proto, tmp_path / "float.onnx")
    feeds = [random_feed(proto, seed=s) for s in range(8)]
    model = qpasses.quantize(qpasses.load(tmp_path / "float.onnx"), feeds)
    out = qpasses.save(model, tmp_path / "q.onnx")
    assert (tmp_path / "q.onnx.data").stat().st_size >= 6 * 128 * 128  # the 8-bit weights
    saved = onnx.load(str(out), load_external_data=False)
    assert sum(t.data_location == TensorProto.EXTERNAL for t in saved.graph.initializer) >= 6
    # 8-bit weights: uint8 where their int8 pair sums could saturate without VNNI (protect-pair-sums)
    assert sum(t.data_type in (TensorProto.INT8, TensorProto.UINT8) and t.dims == [128, 128]
               for t in saved.graph.initializer) >= 6
    import onnxruntime as ort

    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    ref = np.concatenate([run(proto, f)[0] for f in feeds])
    got = np.concatenate([session.run(None, f)[0] for f in feeds])
    assert 10 * np.log10(np.sum(ref ** 2) / np.sum((ref - got) ** 2)) > 25
    again = qpasses.load(out)
    assert again.quant == model.quant and "qdq-inserted" in again.facts
    check_onnx(again)
    # the in-memory calibration path measured what the serialised one measures
    monkeypatch.setattr(segments, "IN_MEMORY_BYTES", 2**62)
    serialised = qpasses.quantize(qpasses.load(tmp_path / "float.onnx"), feeds)
    assert list(serialised.ranges) == list(model.ranges)
    for name, got in model.ranges.items():   # without prepacked weights, MatMul sums in another order
        np.testing.assert_allclose(got, serialised.ranges[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_cleanup_merges_big_equal_weights_by_sampled_fingerprint():
    """Large constants are fingerprinted from samples, then compared in full: equal ones merge,
    ones that differ only between the samples do not."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((256, 256)) / 16).astype(np.float32)   # 256 KB: sampled fingerprint
    twin, near = w.copy(), w.copy()
    near[100, 7] += 1.0                                              # outside the sampled bytes
    inits = [numpy_helper.from_array(a, n) for a, n in ((w, "w"), (twin, "twin"), (near, "near"))]
    nodes = [helper.make_node("MatMul", ["x", n], [f"y_{n}"]) for n in ("w", "twin", "near")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info(f"y_{n}", TensorProto.FLOAT, [1, 256])
                               for n in ("w", "twin", "near")], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 10
    model = from_proto(proto)
    records = pipeline.PassManager("cleanup").run(model)
    assert records[0].stats["initializers_merged"] == 1
    assert [n.inputs[1].name for n in model.graph.nodes] == ["w", "w", "near"]
    feed = random_feed(proto)
    for got, ref in zip(run(model, feed), run(proto, feed)):
        np.testing.assert_array_equal(got, ref)


def test_the_cli_commits_a_model_saved_with_external_data(tmp_path, monkeypatch, capsys):
    """`qpasses run` saves into its staging folder in place (ir.save(atomic=False)): the model and
    its .data file are both committed, and nothing else is left beside them."""
    from qpasses.cli import main

    monkeypatch.setattr(ir, "EXTERNAL_DATA_THRESHOLD", 64 * 1024)
    onnx.save(_mlp(layers=3, width=128), str(tmp_path / "float.onnx"))
    out = tmp_path / "out"
    out.mkdir()
    assert main(["run", str(tmp_path / "float.onnx"), "-o", str(out / "q.onnx"), "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["q.onnx", "q.onnx.data"]
    saved = onnx.load(str(out / "q.onnx"), load_external_data=False)
    assert any(t.data_location == TensorProto.EXTERNAL for t in saved.graph.initializer)
    again = qpasses.load(out / "q.onnx")
    assert len(again.graph.nodes) == len(qpasses.load(tmp_path / "float.onnx").graph.nodes)
