"""The networkx dataflow view."""
import networkx as nx
import pytest

from qpasses.ir.dataflow import dataflow
from qpasses.testing import model_from_text

MODEL = """
agraph (float[2, 3] x) => (float[2, 3] y, float[2, 3] z) <float[3] c = {1.0, 2.0, 3.0}> {
    a = Add(x, c)
    b = Mul(a, a)
    y = Relu(b)
    z = Sigmoid(a)
}
"""


def test_view_has_sources_ops_and_tensor_keys():
    model = model_from_text(MODEL)
    view = dataflow(model)
    g = view.graph
    kinds = sorted(d["kind"] for _, d in g.nodes(data=True))
    assert kinds == ["initializer", "input", "op", "op", "op", "op", "output", "output"]
    mul = view.node_id[model.graph.nodes[1].name]
    assert [(k, d["slots"]) for _, _, k, d in g.in_edges(mul, keys=True, data=True)] == [("a", [0, 1])]
    assert view.writer("a") == model.graph.nodes[0].name
    assert view.writer("x") is None and view.writer("c") is None
    assert view.readers("a") == [model.graph.nodes[1].name, model.graph.nodes[3].name]
    assert nx.is_directed_acyclic_graph(g)


def test_view_is_frozen_and_cached_per_generation():
    model = model_from_text(MODEL)
    first = dataflow(model)
    assert dataflow(model) is first
    with pytest.raises(nx.NetworkXError):
        first.graph.add_node(99)
    model.touch()
    assert dataflow(model) is not first
