"""Large models: calibration over a chain of onnxruntime sessions, and the external-data path
(load -> quantize -> save) through the full default pipeline."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qpasses
from qpasses.calibration import runner
from qpasses.ir import from_proto
from qpasses.testing import parse, random_feed, run
from qpasses.verify import check_onnx

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
    monkeypatch.setattr(runner, "CHUNK_NODES", 4)
    plan = runner._Plan(from_proto(proto), method != "minmax")
    assert len(plan.segments) > 3
    many, _ = runner.collect_stats(from_proto(proto), feeds, method=method)
    assert list(many) == list(one) and "bigr" in many and "joined" in many
    for name in one:
        np.testing.assert_allclose(many[name].observed, one[name].observed, rtol=1e-6, err_msg=name)
    if method == "entropy":
        assert all(many[n].hist.total == one[n].hist.total for n in one)


def test_a_sequence_value_is_never_cut(monkeypatch):
    monkeypatch.setattr(runner, "CHUNK_NODES", 2)
    proto = _chain_model(3)
    model = from_proto(proto)
    chain = runner._Chain(model, model.to_proto(), runner._inferred(model.to_proto())[0])
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
